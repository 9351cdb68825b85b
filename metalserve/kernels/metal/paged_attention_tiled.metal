// Tiled varlen paged attention (prefill-grade), the body that mx.fast.metal_kernel wraps (tiled.py).
// One threadgroup = one query tile of one request x one KV head: M rows, row m = (token t0 + m / group,
// query head kvh * group + m % group), as vLLM's unified attention packs tokens and GQA heads. It walks
// the tile's key range in tiles of BK keys through the block table, stages K and V in threadgroup
// memory with vector loads (read once per query tile), and each simdgroup computes S = Q K^T and
// O += P V for its 8 rows with 8x8 simdgroup multiply-accumulates in fp32, with an online softmax per
// row. Template constants: T (q/kv/out dtype), D, BK (keys per tile), M (rows, 8 per simdgroup),
// INT8 (the pools hold int8 codes, k_scales / v_scales a float16 scale per slot and KV head), Q4, GS
// (uint8 pools of two 4-bit codes a byte; k/v_scales and k/v_biases per group of GS channels).
// Scalars: num_reqs, max_blocks, block_size, group, tile_q (tokens per tile), window (0: none),
// scale, softcap (0: none), use_sinks.
constexpr int DF = D / 8;  // 8-wide fragments across the head dim
constexpr int KF = BK / 8;  // 8-wide fragments across a key tile
constexpr int NT = M * 4;  // threads: M / 8 simdgroups of 32
const int tile = int(threadgroup_position_in_grid.x);
const int kvh = int(threadgroup_position_in_grid.y);
const int num_kv_heads = int(threadgroups_per_grid.y);
const int num_q_heads = num_kv_heads * group;
const int sg = int(simdgroup_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);
const int tid = int(thread_index_in_threadgroup);

// Request r's tiles start at cu_seqlens_q[r] / tile_q + r (an upper bound, as in vLLM); find ours.
int lo = 0;
int hi = num_reqs - 1;
while (lo < hi) {
  const int mid = (lo + hi + 1) / 2;
  if (cu_seqlens_q[mid] / tile_q + mid <= tile) {
    lo = mid;
  } else {
    hi = mid - 1;
  }
}
const int req = lo;
const int q_start = cu_seqlens_q[req];
const int q_end = cu_seqlens_q[req + 1];
const int t0 = q_start + (tile - (q_start / tile_q + req)) * tile_q;
if (t0 >= q_end) {
  return;  // a spare tile of the upper bound: the whole threadgroup leaves together
}
const int t1 = metal::min(t0 + tile_q, q_end);
const int pos0 = seq_lens[req] - (q_end - q_start) - q_start;  // token t sits at position pos0 + t
const int rows = (t1 - t0) * group;
// Keys the tile needs: up to its last query's position, from its first query's window start.
const int key_hi = pos0 + t1;
const int key_lo = window > 0 ? metal::max(0, pos0 + t0 - window + 1) : 0;

// This lane's fragment coordinates (Apple's simdgroup_matrix layout: two adjacent columns per lane).
const int frag_row = ((lane >> 2) & 4) + ((lane >> 1) & 3);
const int frag_col = (((lane >> 3) & 1) << 2) + ((lane & 1) << 1);
// A simdgroup whose 8 rows all lie past the tile's last token (a short request's tile) only stages.
const bool sg_active = sg * 8 < rows;
const int my_row = sg * 8 + frag_row;
const bool my_row_valid = my_row < rows;
// Keys any of this simdgroup's rows sees: 8-key fragments wholly outside are skipped (causal diagonal,
// window), exactly, since the softmax masks them anyway.
const int sg_key_hi = pos0 + t0 + (metal::min(rows, sg * 8 + 8) - 1) / group + 1;
const int sg_key_lo = window > 0 ? pos0 + t0 + (sg * 8) / group - window + 1 : 0;
const long my_out = (long(t0 + my_row / group) * num_q_heads + kvh * group + my_row % group) * D;

const simdgroup_float8x8 zero = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
simdgroup_float8x8 qf[DF];
simdgroup_float8x8 of[DF];
for (int j = 0; j < DF; ++j) {
  qf[j] = zero;
  of[j] = zero;
  if (my_row_valid) {
    qf[j].thread_elements()[0] = float(q[my_out + j * 8 + frag_col]) * scale;
    qf[j].thread_elements()[1] = float(q[my_out + j * 8 + frag_col + 1]) * scale;
  }
}

// Softmax state: 4 lanes per row (lane >> 2), each keeping the row's running max and sum.
const int sm_row = sg * 8 + (lane >> 2);
const int sm_quarter = lane & 3;
const bool sm_valid = sm_row < rows;
const int sm_pos = pos0 + t0 + sm_row / group;
const int sm_first = window > 0 ? sm_pos - window + 1 : 0;
float m_run = -INFINITY;
float l_run = 0.0f;
if (use_sinks && sm_valid) {
  m_run = float(sinks[kvh * group + sm_row % group]);  // the sink: one more key, with zero value
  l_run = 1.0f;
}

threadgroup float sk[BK * D];
threadgroup float sv[BK * D];
threadgroup float ss[M * BK];  // per simdgroup 8 x BK: the scores, then the probabilities
threadgroup float sc[M];  // per row: the rescale factor, at the end 1 / sum
threadgroup float* my_s = ss + sg * 8 * BK;
const long table_row = long(req) * max_blocks;

for (int kt = (key_lo / BK) * BK; kt < key_hi; kt += BK) {
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the last tile's readers are done
  for (int c = tid; c < BK * (D / 4); c += NT) {
    const int kr = c / (D / 4);
    const int d4 = (c % (D / 4)) * 4;
    const int key = kt + kr;
    float4 kx = float4(0.0f);
    float4 vx = float4(0.0f);
    if (key >= key_lo && key < key_hi) {  // others stay zero: finite, and masked below
      const long slot = long(block_tables[table_row + key / block_size]) * block_size + key % block_size;
      const long vector = slot * num_kv_heads + kvh;
      if (Q4) {  // q4 pages: 4 codes in 2 bytes, one channel group's scale and bias (GS is a multiple of 4)
        const long scale_index = vector * (D / GS) + d4 / GS;
        kx = load_q4x4(k_pool + vector * (D / 2) + d4 / 2) * float4(float(k_scales[scale_index])) +
             float4(float(k_biases[scale_index]));
        vx = load_q4x4(v_pool + vector * (D / 2) + d4 / 2) * float4(float(v_scales[scale_index])) +
             float4(float(v_biases[scale_index]));
      } else {
        kx = load_float4(k_pool + vector * D + d4);
        vx = load_float4(v_pool + vector * D + d4);
      }
      if (INT8) {  // int8 pages: codes * the slot's and head's float16 scale, in registers
        kx *= float4(float(k_scales[vector]));
        vx *= float4(float(v_scales[vector]));
      }
    }
    *((threadgroup float4*)(sk + kr * D + d4)) = kx;
    *((threadgroup float4*)(sv + kr * D + d4)) = vx;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (!sg_active) {
    continue;  // simdgroup-uniform: no simdgroup operation is skipped by part of a simdgroup
  }

  for (int kf = 0; kf < KF; ++kf) {
    if (kt + kf * 8 >= sg_key_hi || kt + kf * 8 + 8 <= sg_key_lo) {
      continue;  // simdgroup-uniform; the softmax below never reads these scores as visible
    }
    simdgroup_float8x8 acc = zero;
    for (int j = 0; j < DF; ++j) {
      simdgroup_float8x8 kmat;  // K^T block: rows are head dims, columns keys
      simdgroup_load(kmat, sk + kf * 8 * D + j * 8, D, ulong2(0, 0), true);
      simdgroup_multiply_accumulate(acc, qf[j], kmat, acc);
    }
    simdgroup_store(acc, my_s + kf * 8, BK);
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);

  float s[BK / 4];
  float tile_max = -INFINITY;
  for (int i = 0; i < BK / 4; ++i) {
    const int col = sm_quarter + 4 * i;
    const int key = kt + col;
    const bool visible = sm_valid && key <= sm_pos && key >= sm_first;
    float x = visible ? my_s[(lane >> 2) * BK + col] : 0.0f;  // skipped fragments hold stale scores
    if (softcap > 0.0f) {
      x = softcap * metal::precise::tanh(x / softcap);
    }
    s[i] = visible ? x : -INFINITY;
    tile_max = metal::max(tile_max, s[i]);
  }
  tile_max = metal::max(tile_max, simd_shuffle_xor(tile_max, 1));
  tile_max = metal::max(tile_max, simd_shuffle_xor(tile_max, 2));
  const float m_new = metal::max(m_run, tile_max);
  // A row with nothing seen yet keeps m = -inf; skip it so -inf - -inf never makes a NaN.
  const float corr = m_new == -INFINITY ? 1.0f : metal::exp(m_run - m_new);
  float p_sum = 0.0f;
  for (int i = 0; i < BK / 4; ++i) {
    const float p = s[i] == -INFINITY ? 0.0f : metal::exp(s[i] - m_new);
    my_s[(lane >> 2) * BK + sm_quarter + 4 * i] = p;
    p_sum += p;
  }
  p_sum += simd_shuffle_xor(p_sum, 1);
  p_sum += simd_shuffle_xor(p_sum, 2);
  l_run = l_run * corr + p_sum;
  m_run = m_new;
  if (sm_quarter == 0) {
    sc[sm_row] = corr;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);

  const float my_corr = sc[my_row];
  for (int j = 0; j < DF; ++j) {
    of[j].thread_elements()[0] *= my_corr;
    of[j].thread_elements()[1] *= my_corr;
  }
  for (int kf = 0; kf < KF; ++kf) {
    if (kt + kf * 8 >= sg_key_hi || kt + kf * 8 + 8 <= sg_key_lo) {
      continue;  // all its probabilities are 0
    }
    simdgroup_float8x8 pmat;
    simdgroup_load(pmat, my_s + kf * 8, BK);
    for (int j = 0; j < DF; ++j) {
      simdgroup_float8x8 vmat;
      simdgroup_load(vmat, sv + kf * 8 * D + j * 8, D);
      simdgroup_multiply_accumulate(of[j], pmat, vmat, of[j]);
    }
  }
}

if (!sg_active) {
  return;
}
simdgroup_barrier(mem_flags::mem_threadgroup);  // every lane has read sc for the last tile
if (sm_quarter == 0) {
  sc[sm_row] = l_run > 0.0f ? 1.0f / l_run : 0.0f;
}
simdgroup_barrier(mem_flags::mem_threadgroup);
if (my_row_valid) {
  const float inv = sc[my_row];
  for (int j = 0; j < DF; ++j) {
    out[my_out + j * 8 + frag_col] = T(of[j].thread_elements()[0] * inv);
    out[my_out + j * 8 + frag_col + 1] = T(of[j].thread_elements()[1] * inv);
  }
}
