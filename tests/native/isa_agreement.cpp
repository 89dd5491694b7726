// Standalone check that every instruction-set path of the native matmul (8-bit and float activations) equals the
// scalar path bit for bit, on random repacked weights of every block type, float weights of every float type and
// several row counts. Built without torch, so it runs wherever the kernels' C++ compiles (tests/test_kernels_arm.py
// builds it for aarch64 and runs it under qemu-user).
// Prints "N passed, M failed"; exits non-zero on any failure.
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "fmatmul.h"
#include "qmatmul.h"

using namespace sparsespec;

static uint16_t random_half(std::mt19937& rng) {
  // a finite normal half in roughly [2^-9, 2^-6), random sign
  return (uint16_t)(0x1800 + (rng() % 0x0C00)) | (uint16_t)((rng() & 1) << 15);
}

// Column tiles: random codes and scales, finite halves for each chunk's d (and Q4_K's dmin) of 16 columns.
static void fill_tiles(int type, int n, int k, std::vector<uint8_t>& w, std::mt19937& rng) {
  w.resize(weight_bytes(type, k, n));
  for (auto& b : w) b = (uint8_t)rng();
  const std::size_t chunk_bytes = tile_bytes(type, k) / (k / tile_span(type));
  const int halves = type == Q4_K_T16 ? 32 : 16;
  for (std::size_t at = 0; at < w.size(); at += chunk_bytes)
    for (int h = 0; h < halves; ++h) {
      const uint16_t v = random_half(rng);
      std::memcpy(w.data() + at + 2 * h, &v, 2);
    }
}

static void fill_weights(int type, int n, int k, std::vector<uint8_t>& w, std::mt19937& rng) {
  if (is_tiled(type)) return fill_tiles(type, n, k, w, rng);
  const std::size_t rb = row_bytes(type, k);
  w.resize(rb * n);
  for (auto& b : w) b = (uint8_t)rng();
  const int sb = scale_bytes(type), qb = quarter_bytes(type);
  for (int r = 0; r < n; ++r) {
    uint8_t* row = w.data() + rb * r;
    for (int c = 0; c * 256 < k; ++c) {
      const int quarters = (k - c * 256) >= 256 ? 4 : (k - c * 256) / 64;
      uint8_t* chunk = row + (std::size_t)c * (sb + 4 * qb);
      const int halves = (type == Q4_1 || type == Q5_1) ? 16 : (type == Q4_K || type == Q5_K) ? 2
                         : type == Q6_K ? 1 : 8;
      for (int h = 0; h < halves; ++h) {
        const uint16_t v = random_half(rng);
        std::memcpy(chunk + 2 * h, &v, 2);
      }
      if (type == Q8_0)
        for (int p = 0; p < quarters; ++p)
          for (int j = 0; j < 64; ++j)
            if ((int8_t)chunk[sb + p * qb + j] == -128) chunk[sb + p * qb + j] = 0x81;
    }
  }
}

int main() {
  std::mt19937 rng(1234);
  const int types[] = {Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, Q4_K_T16, Q6_K_T16, Q5_0_T16};
  std::vector<int> isas;
  for (int isa : {kAvx2, kAvx512, kAmx, kNeon})
    if (isa_available(isa)) isas.push_back(isa);
  if (isas.empty()) {
    std::printf("no SIMD path runs here\n0 passed, 1 failed\n");
    return 1;
  }
  int passed = 0, failed = 0;
  for (int type : types) {
    const bool k_quant = is_k_quant(type);
    for (int k : {k_quant ? 256 : 96, k_quant ? 768 : 576, k_quant ? 1280 : 608}) {
      const int n = 37;
      std::vector<uint8_t> w;
      fill_weights(type, n, k, w, rng);
      for (int m : {1, 2, 3, 5, 8, 13, 16, 17}) {
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::vector<float> x((std::size_t)m * k);
        for (auto& v : x) v = normal(rng);
        const int k_pad = padded_k(k);
        std::vector<int8_t> q((std::size_t)m * k_pad);
        std::vector<float> dx((std::size_t)m * k_pad / 32), ds((std::size_t)m * k_pad / 16), dxl((std::size_t)m * k_pad / 4);
        std::vector<int32_t> xsum((std::size_t)m * k_pad / 32);
        quantize_activations(kScalar, x.data(), m, k, k, q.data(), dx.data(), ds.data(), dxl.data(), xsum.data());
        std::vector<int8_t> q256((std::size_t)m * k_pad);
        std::vector<float> d256((std::size_t)m * k_pad / 256);
        std::vector<int32_t> bsum((std::size_t)m * k_pad / 16);
        quantize_activations_256(kScalar, x.data(), m, k, k, q256.data(), d256.data(), bsum.data());
        for (int isa : isas) {  // every instruction set's quantizers write the portable path's bytes
          auto q_i = q, q256_i = q256;
          auto dx_i = dx, ds_i = ds, dxl_i = dxl, d256_i = d256;
          auto xsum_i = xsum, bsum_i = bsum;
          quantize_activations(isa, x.data(), m, k, k, q_i.data(), dx_i.data(), ds_i.data(), dxl_i.data(),
                               xsum_i.data());
          quantize_activations_256(isa, x.data(), m, k, k, q256_i.data(), d256_i.data(), bsum_i.data());
          if (q_i == q && dx_i == dx && ds_i == ds && dxl_i == dxl && xsum_i == xsum && q256_i == q256 &&
              d256_i == d256 && bsum_i == bsum) {
            ++passed;
          } else {
            ++failed;
            std::printf("MISMATCH %s activations k %d m %d\n", isa_name(isa), k, m);
          }
        }
        const Activations act{m,           k_pad,       q.data(),    dx.data(),  ds.data(), dxl.data(),
                              xsum.data(), q256.data(), d256.data(), bsum.data()};
        std::vector<float> bias(n), reference((std::size_t)m * n), out((std::size_t)m * n);
        for (auto& b : bias) b = normal(rng);
        qmatmul_rows(kScalar, type, w.data(), k, 0, n, act, bias.data(), reference.data(), n);
        for (int isa : isas) {
          std::fill(out.begin(), out.end(), -1.0f);
          qmatmul_rows(isa, type, w.data(), k, 0, n, act, bias.data(), out.data(), n);
          if (is_tiled(type)) {  // columns split off the tiles' edges, as threads may split them
            std::vector<float> split((std::size_t)m * n, -1.0f);
            qmatmul_rows(isa, type, w.data(), k, 0, 21, act, bias.data(), split.data(), n);
            qmatmul_rows(isa, type, w.data(), k, 21, n, act, bias.data(), split.data(), n);
            if (std::memcmp(split.data(), out.data(), out.size() * sizeof(float)) != 0) out[0] = -2.0f;
          }
          if (std::memcmp(out.data(), reference.data(), out.size() * sizeof(float)) == 0) {
            ++passed;
          } else {
            ++failed;
            std::printf("MISMATCH %s type %d k %d m %d\n", isa_name(isa), type, k, m);
          }
        }
        if (is_tiled(type)) continue;  // float activations read the row layout only
        fmatmul_rows(kScalar, type, w.data(), k, 0, n, x.data(), m, k, bias.data(), reference.data(), n);
        for (int isa : isas) {  // whole, and with the columns split as threads may split them
          std::fill(out.begin(), out.end(), -1.0f);
          fmatmul_rows(isa, type, w.data(), k, 0, n, x.data(), m, k, bias.data(), out.data(), n);
          std::vector<float> split((std::size_t)m * n, -1.0f);
          fmatmul_rows(isa, type, w.data(), k, 0, 21, x.data(), m, k, bias.data(), split.data(), n);
          fmatmul_rows(isa, type, w.data(), k, 21, n, x.data(), m, k, bias.data(), split.data(), n);
          if (std::memcmp(out.data(), reference.data(), out.size() * sizeof(float)) == 0 &&
              std::memcmp(split.data(), reference.data(), out.size() * sizeof(float)) == 0) {
            ++passed;
          } else {
            ++failed;
            std::printf("MISMATCH %s float activations type %d k %d m %d\n", isa_name(isa), type, k, m);
          }
        }
      }
    }
  }
  for (int type : {F32, F16, BF16}) {  // float weights: random finite values of the type
    for (int k : {16, 48, 576, 656}) {
      const int n = 37;
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<uint8_t> w(weight_bytes(type, k, n));
      for (std::size_t i = 0; i < w.size(); i += float_type_bytes(type)) {
        const float v = normal(rng);
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        const uint16_t half = random_half(rng), high = (uint16_t)(bits >> 16);
        if (type == F32) std::memcpy(w.data() + i, &v, 4);
        else std::memcpy(w.data() + i, type == F16 ? &half : &high, 2);
      }
      for (int m : {1, 2, 3, 5, 8, 13}) {
        std::vector<float> x((std::size_t)m * k), bias(n), reference((std::size_t)m * n), out((std::size_t)m * n);
        for (auto& v : x) v = normal(rng);
        for (auto& b : bias) b = normal(rng);
        fmatmul_rows(kScalar, type, w.data(), k, 0, n, x.data(), m, k, bias.data(), reference.data(), n);
        for (int isa : isas) {
          std::fill(out.begin(), out.end(), -1.0f);
          fmatmul_rows(isa, type, w.data(), k, 0, 21, x.data(), m, k, bias.data(), out.data(), n);
          fmatmul_rows(isa, type, w.data(), k, 21, n, x.data(), m, k, bias.data(), out.data(), n);
          if (std::memcmp(out.data(), reference.data(), out.size() * sizeof(float)) == 0) {
            ++passed;
          } else {
            ++failed;
            std::printf("MISMATCH %s float weights type %d k %d m %d\n", isa_name(isa), type, k, m);
          }
        }
      }
    }
  }
  std::printf("instruction sets checked against scalar:");
  for (int isa : isas) std::printf(" %s", isa_name(isa));
  std::printf("\n%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
