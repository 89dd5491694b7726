// RMS norm of the decoder's rows (elementwise.h), as torch's fused rms_norm computes it.
#include <cmath>
#include <vector>

#include "elementwise.h"
#include "parallel.h"

namespace sparsespec {

void rms_norm_rows(const void* x, int64_t m, int64_t n, bool bf16, const void* weight, bool weight_bf16, float eps,
                   void* out) {
  auto element = [](const void* data, bool is_bf16, int64_t i) {
    return is_bf16 ? bf16_to_float(static_cast<const uint16_t*>(data)[i]) : static_cast<const float*>(data)[i];
  };
  parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row((std::size_t)n);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < n; ++j) row[j] = element(x, bf16, r * n + j);
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // fixed order: lane l sums elements l, l + 8, ...; then in turn
      int64_t j = 0;
      for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; ++l) lanes[l] += row[j + l] * row[j + l];
      float sum = 0.0f;
      for (int l = 0; l < 8; ++l) sum += lanes[l];
      for (; j < n; ++j) sum += row[j] * row[j];
      const float inv = 1.0f / std::sqrt(sum / (float)n + eps);
      for (j = 0; j < n; ++j) {
        const float y = row[j] * inv * element(weight, weight_bf16, j);
        if (bf16)
          static_cast<uint16_t*>(out)[r * n + j] = float_to_bf16(y);
        else
          static_cast<float*>(out)[r * n + j] = y;
      }
    }
  });
}

}  // namespace sparsespec
