#pragma once
// main() of the AddressSanitizer build: buffers come from a file, each in its own exact-size
// allocation so a read past any buffer's end hits ASan's redzone; results go back to a file.
// File layout: u32 count, then per buffer u64 size and bytes; then u32 dims[6], i32 reverse.
#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 2;
  uint32_t count = 0;
  if (std::fread(&count, 4, 1, in) != 1) return 2;
  std::vector<void*> bufs(count);
  std::vector<uint64_t> sizes(count);
  for (uint32_t i = 0; i < count; ++i) {
    if (std::fread(&sizes[i], 8, 1, in) != 1) return 2;
    bufs[i] = std::malloc(sizes[i] ? sizes[i] : 1);
    if (sizes[i] && std::fread(bufs[i], 1, sizes[i], in) != sizes[i]) return 2;
  }
  unsigned dims[6];
  int reverse = 0;
  if (std::fread(dims, 4, 6, in) != 6 || std::fread(&reverse, 4, 1, in) != 1) return 2;
  std::fclose(in);
  char err[4096] = {0};
  unsigned long long counts[msl_rt::kNumCounts] = {0};
  int rc = msl_run(bufs.data(), dims, reverse, 1, 1 << 20, err, sizeof(err), counts);
  if (rc != 0) {
    std::fprintf(stderr, "emulator error: %s\n", err);
    return 3;
  }
  FILE* out = std::fopen(argv[2], "wb");
  for (uint32_t i = 0; i < count; ++i) std::fwrite(bufs[i], 1, sizes[i], out);
  std::fclose(out);
  return 0;
}
