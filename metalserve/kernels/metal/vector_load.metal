// Header of the tiled kernel: four consecutive pool elements as one vector load, widened to float.
// bfloat travels as its 16 bits (ushort4), so this also builds where Metal has no bfloat type.
inline float4 load_float4(const device float* p) {
  return *((const device float4*)(p));
}
inline float4 load_float4(const device half* p) {
  return float4(*((const device half4*)(p)));
}
inline float4 load_float4(const device bfloat16_t* p) {
  const ushort4 b = *((const device ushort4*)(p));
  return float4(as_type<float>(uint(b.x) << 16), as_type<float>(uint(b.y) << 16),
                as_type<float>(uint(b.z) << 16), as_type<float>(uint(b.w) << 16));
}
inline float4 load_float4(const device int8_t* p) {  // int8 KV codes; the caller applies the scale
  return float4(*((const device char4*)(p)));
}
