// Second pass of split-KV attention: merges the partitions' unnormalised partials for one query
// token (threadgroup x) and query head (threadgroup y); lanes split the head dim. The sink logit,
// if any, joins the softmax here. Template constants: O (out dtype), D, SINKS. Scalar: num_parts.
const int t = int(threadgroup_position_in_grid.x);
const int h = int(threadgroup_position_in_grid.y);
const int num_tokens = int(threadgroups_per_grid.x);
const int num_q_heads = int(threadgroups_per_grid.y);
const int lane = int(thread_index_in_threadgroup);
const int width = int(threads_per_threadgroup.x);

float big = SINKS ? float(sinks[h]) : -INFINITY;
for (int p = 0; p < num_parts; ++p) {
  big = metal::max(big, part_ml[((long(p) * num_tokens + t) * num_q_heads + h) * 2]);
}
float total = SINKS ? metal::exp(float(sinks[h]) - big) : 0.0f;
for (int p = 0; p < num_parts; ++p) {
  const long ml = ((long(p) * num_tokens + t) * num_q_heads + h) * 2;
  if (part_ml[ml] != -INFINITY) {
    total += part_ml[ml + 1] * metal::exp(part_ml[ml] - big);
  }
}
for (int d = lane; d < D; d += width) {
  float o = 0.0f;
  for (int p = 0; p < num_parts; ++p) {
    const long ml = ((long(p) * num_tokens + t) * num_q_heads + h) * 2;
    if (part_ml[ml] != -INFINITY) {
      o += part_o[((long(p) * num_tokens + t) * num_q_heads + h) * D + d] * metal::exp(part_ml[ml] - big);
    }
  }
  out[(long(t) * num_q_heads + h) * D + d] = O(total > 0.0f ? o / total : 0.0f);
}
