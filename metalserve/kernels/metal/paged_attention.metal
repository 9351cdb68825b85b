// Varlen paged attention, the body that mx.fast.metal_kernel wraps (see metal.py for the launch).
// One threadgroup = one query token x one KV head x one KV partition; it serves all G query heads
// that share the KV head (GQA). Its NSG simdgroups take keys round-robin, each keeping an online
// softmax per head; lanes split the head dim. The simdgroups' partial results merge in threadgroup
// memory. With PART > 0 each threadgroup covers keys [part * PART, (part + 1) * PART) and writes
// unnormalised partials (out) and their (max, sum) (part_ml) for paged_attention_merge.metal.
// Template constants: T (q/kv dtype), O (out dtype), D, BS (block size), G, NSG, PART, WINDOW,
// SOFTCAP, SINKS, INT8, Q4, GS. Scalars: num_reqs, max_blocks, window, scale, softcap.
// INT8: the pools hold int8 codes and k_scales / v_scales one float16 scale per slot and KV head;
// each key and value is dequantized in registers (codes * scale) right after it is loaded. Q4: uint8
// pools of two 4-bit codes a byte, k/v_scales and k/v_biases per group of GS channels (codes * s + b).
constexpr int DPL = (D + 31) / 32;  // head dims per lane
const int t = int(threadgroup_position_in_grid.x);
const int kvh = int(threadgroup_position_in_grid.y);
const int part = int(threadgroup_position_in_grid.z);
const int num_tokens = int(threadgroups_per_grid.x);
const int num_kv_heads = int(threadgroups_per_grid.y);
const int num_q_heads = num_kv_heads * G;
const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int tid = int(thread_index_in_threadgroup);

// Which request owns token t: the last r with cu_seqlens_q[r] <= t.
int lo = 0;
int hi = num_reqs - 1;
while (lo < hi) {
  const int mid = (lo + hi + 1) / 2;
  if (cu_seqlens_q[mid] <= t) {
    lo = mid;
  } else {
    hi = mid - 1;
  }
}
const int req = lo;
const int q_len = cu_seqlens_q[req + 1] - cu_seqlens_q[req];
const int pos = seq_lens[req] - q_len + (t - cu_seqlens_q[req]);

// Keys this threadgroup sees: causal, then the window, then its partition.
int key_lo = 0;
int key_hi = pos + 1;
if (WINDOW) {
  key_lo = metal::max(0, pos - window + 1);
}
if (PART > 0) {
  key_lo = metal::max(key_lo, part * PART);
  key_hi = metal::min(key_hi, (part + 1) * PART);
}

float qr[G][DPL];
float acc[G][DPL];
float m[G];
float l[G];
for (int g = 0; g < G; ++g) {
  const long q_row = (long(t) * num_q_heads + kvh * G + g) * D;
  for (int j = 0; j < DPL; ++j) {
    const int d = lane + 32 * j;
    qr[g][j] = d < D ? float(q[q_row + d]) * scale : 0.0f;
    acc[g][j] = 0.0f;
  }
  m[g] = -INFINITY;
  l[g] = 0.0f;
}

const long table_row = long(req) * max_blocks;
for (int key = key_lo + sg; key < key_hi; key += NSG) {
  const long slot = long(block_tables[table_row + key / BS]) * BS + key % BS;
  const long vector = slot * num_kv_heads + kvh;
  const long kv_row = vector * D;
  // Dequantization scales: 1 for float pools (the compiler folds the multiply away).
  const float k_scale = INT8 ? float(k_scales[vector]) : 1.0f;
  const float v_scale = INT8 ? float(v_scales[vector]) : 1.0f;
  float kr[DPL];
  float vr[DPL];
  for (int j = 0; j < DPL; ++j) {
    const int d = lane + 32 * j;
    if (Q4) {  // two codes a byte (the even channel low), a scale and a bias per group of GS channels
      const int shift = (d & 1) * 4;
      const long group = vector * (D / GS) + d / GS;
      kr[j] = d < D ? float((uint(k_pool[vector * (D / 2) + d / 2]) >> shift) & 15u) * float(k_scales[group]) +
                          float(k_biases[group])
                    : 0.0f;
      vr[j] = d < D ? float((uint(v_pool[vector * (D / 2) + d / 2]) >> shift) & 15u) * float(v_scales[group]) +
                          float(v_biases[group])
                    : 0.0f;
    } else {
      kr[j] = d < D ? float(k_pool[kv_row + d]) * k_scale : 0.0f;
      vr[j] = d < D ? float(v_pool[kv_row + d]) * v_scale : 0.0f;
    }
  }
  for (int g = 0; g < G; ++g) {
    float partial = 0.0f;
    for (int j = 0; j < DPL; ++j) {
      partial += qr[g][j] * kr[j];
    }
    float s = simd_sum(partial);
    if (SOFTCAP) {
      s = softcap * metal::precise::tanh(s / softcap);
    }
    const float m_new = metal::max(m[g], s);
    const float correction = metal::exp(m[g] - m_new);
    const float p = metal::exp(s - m_new);
    l[g] = l[g] * correction + p;
    for (int j = 0; j < DPL; ++j) {
      acc[g][j] = acc[g][j] * correction + p * vr[j];
    }
    m[g] = m_new;
  }
}

// Merge the simdgroups, one query head at a time to keep threadgroup memory at NSG * (D + 2) floats.
threadgroup float tg_m[NSG];
threadgroup float tg_l[NSG];
threadgroup float tg_acc[NSG * D];
for (int g = 0; g < G; ++g) {
  if (lane == 0) {
    tg_m[sg] = m[g];
    tg_l[sg] = l[g];
  }
  for (int j = 0; j < DPL; ++j) {
    const int d = lane + 32 * j;
    if (d < D) {
      tg_acc[sg * D + d] = acc[g][j];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const int h = kvh * G + g;
  float big = -INFINITY;
  for (int s = 0; s < NSG; ++s) {
    big = metal::max(big, tg_m[s]);
  }
  if (SINKS && PART == 0) {
    big = metal::max(big, float(sinks[h]));
  }
  float weight[NSG];
  float total = 0.0f;
  for (int s = 0; s < NSG; ++s) {
    // An empty simdgroup has m = -inf; skip it so -inf - -inf never makes a NaN.
    weight[s] = tg_m[s] == -INFINITY ? 0.0f : metal::exp(tg_m[s] - big);
    total += tg_l[s] * weight[s];
  }
  if (SINKS && PART == 0) {
    total += metal::exp(float(sinks[h]) - big);
  }
  for (int d = tid; d < D; d += NSG * 32) {
    float o = 0.0f;
    for (int s = 0; s < NSG; ++s) {
      o += tg_acc[s * D + d] * weight[s];
    }
    if (PART > 0) {
      out[((long(part) * num_tokens + t) * num_q_heads + h) * D + d] = O(o);
    } else {
      out[(long(t) * num_q_heads + h) * D + d] = O(total > 0.0f ? o / total : 0.0f);
    }
  }
  if (PART > 0 && tid == 0) {
    const long ml = ((long(part) * num_tokens + t) * num_q_heads + h) * 2;
    part_ml[ml] = big;
    part_ml[ml + 1] = total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
