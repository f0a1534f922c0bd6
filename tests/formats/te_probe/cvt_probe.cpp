// Host-side NVIDIA conversions (cuda_fp4.h / cuda_fp8.h) on the values the te profile must agree
// with: prints "float_bits e2m1_code e4m3_satfinite_byte" per line. Run once on a machine with the
// CUDA headers; the output is compared with the te profile in test_nvfp4_te.py.
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <vector>

int main() {
  std::vector<float> v = {0.0f, -0.0f, NAN, -NAN, INFINITY, -INFINITY, 1e-40f, -1e-40f, -1e-9f,
                          6.0f, 6.5f, 7.0f, 1e30f, -1e30f, 448.0f, 460.0f, 464.0f, 500.0f};
  const float grid[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  for (float g : grid) {
    for (int d = -2; d <= 2; ++d) {
      float x = g;
      for (int i = 0; i < (d < 0 ? -d : d); ++i) x = std::nextafter(x, d < 0 ? 0.0f : 10.0f);
      v.push_back(x);
      v.push_back(-x);
    }
  }
  for (int e = -12; e <= 9; ++e)
    for (int m = 0; m < 32; ++m) v.push_back(std::ldexp(1.0f + m / 32.0f, e));
  uint32_t nan_payload = 0x7fa00001u;  // a signalling-style payload
  float odd_nan;
  std::memcpy(&odd_nan, &nan_payload, 4);
  v.push_back(odd_nan);
  for (float x : v) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    unsigned c4 = __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
    unsigned c8 = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    std::printf("%08x %u %u\n", bits, c4, c8);
  }
  return 0;
}
