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
inline float4 load_float4(const device uint8_t* p) {  // q4 pools take load_q4x4; here for the overload set
  return float4(*((const device uchar4*)(p)));
}
inline float4 load_q4x4(const device uint8_t* p) {  // four 4-bit codes from two bytes, the even one low
  const uint b = uint(p[0]) | (uint(p[1]) << 8);
  return float4(float(b & 15u), float((b >> 4) & 15u), float((b >> 8) & 15u), float((b >> 12) & 15u));
}
inline float4 load_q4x4(const device float* p) {  // unused: float pools take load_float4
  return float4(0.0f);
}
inline float4 load_q4x4(const device half* p) {
  return float4(0.0f);
}
inline float4 load_q4x4(const device bfloat16_t* p) {
  return float4(0.0f);
}
inline float4 load_q4x4(const device int8_t* p) {
  return float4(0.0f);
}
