// CPU kernels for decode rows (each stream one new token; a lone stream above all) of a Llama layer, bf16 or fp32.
//
// At a few rows a layer's four products are matrix-vector products that read the whole weight once, and the rest
// of the layer (norms, rotary, attention over each stream's keys, SiLU) is a few thousand elements a row. Run as torch ops
// each piece is a dispatch and, for the products, a oneDNN call that reads 15-21 GB/s of a machine's ~50; here the
// products stream each weight row once (AVX512-BF16 dot products where the CPU has them) and the whole layer is
// one call.
//
//   deepinfer_cpu::gemv(x, w, bf16_out)   x (K,) or (M, K), w (N, K), bf16 or fp32 -> fp32 sums, or rounded to bf16
//   deepinfer_cpu::decode_layer(...)      one layer for B decode rows, in place: see decode_layer below
//   deepinfer_cpu::q4_gemv(x, codes, d, c, bf16_out)   the product with a Q4_1 weight (see Mat below)
//   deepinfer_cpu::int8_gemv(x, q, scale, bf16_out)    the product with per-row int8 weights
//   deepinfer_cpu::decode_layer_q(...)    decode_layer with quantized weights: each [codes, d, c] or [q, scale]
//   deepinfer_cpu::set_native_bf16(on)    AVX512-BF16 dot products on / off (tests reach the portable form)
//
// Values follow the eager CPU step's bf16 form (models/llama_step.py): every op's result is rounded to bf16 where
// the eager step stores one (norm, each product, rotary's two products and their sum, the residual adds, SiLU and
// its product with up); sums run in fp32, in another order than oneDNN's, so results differ from the module path
// in the last bits (tolerance: test/e2e/test_cpu_step.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

// The kernels' own threads. A layer is five short parallel sections (four products and attention) a few
// microseconds apart. Under torch's OpenMP, once two threads have run parallel regions (the caller that loaded
// the model and the engine's loop thread) libgomp counts more threads than cores and lets idle workers sleep at
// once, so every section paid a wake-up: 17 ms a step of the embedded default against 13 ms without. These
// workers spin between sections for up to kSpin, then sleep until the next one. torch.set_num_threads sets how
// many take part (the caller is one of them).
class Workers {
 public:
  static constexpr auto kSpin = std::chrono::microseconds(200);

  // fn(part, parts) on `parts` threads, the caller being part 0; returns when every part has.
  void run(int parts, const std::function<void(int, int)>& fn) {
    parts = std::max(1, parts);
    if (parts == 1) {
      fn(0, 1);
      return;
    }
    grow(parts - 1);
    task_ = &fn;
    parts_ = parts;
    remaining_.store(parts - 1, std::memory_order_seq_cst);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    fn(0, parts);
    while (remaining_.load(std::memory_order_acquire) > 0) _mm_pause();
  }

 private:
  void grow(int wanted) {
    while (int(threads_) < wanted) {
      const int index = int(threads_) + 1;
      const uint64_t seen = generation_.load(std::memory_order_seq_cst);  // before this section's
      std::thread([this, index, seen] { loop(index, seen); }).detach();  // never joined: lives as long as the process
      ++threads_;
    }
  }

  void loop(int index, uint64_t seen) {
    while (true) {
      const auto start = std::chrono::steady_clock::now();
      int spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        _mm_pause();
        if (++spins % 256 == 0 && std::chrono::steady_clock::now() - start > kSpin) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_seq_cst);
        }
      }
      seen = generation_.load(std::memory_order_acquire);
      if (index < parts_) {  // workers beyond this section's count sit it out
        (*task_)(index, parts_);
        remaining_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  size_t threads_ = 0;
  const std::function<void(int, int)>* task_ = nullptr;
  int parts_ = 1;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<int> sleeping_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
};

Workers*& workers() {
  static Workers* pool = [] {
    // a forked child has none of the parent's threads: it starts its own (the parent's object is left behind)
    pthread_atfork(nullptr, nullptr, [] { workers() = new Workers(); });
    return new Workers();
  }();
  return pool;
}

// fn(begin, end) over [0, n) split into at most torch.get_num_threads() ranges of whole `align`s
void parallel_ranges(int64_t n, int64_t align, int64_t min_per_part, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t most = std::max<int64_t>(1, n / std::max<int64_t>(min_per_part, 1));
  const int parts = int(std::min<int64_t>(at::get_num_threads(), most));
  const int64_t units = (n + align - 1) / align;
  workers()->run(parts, [&](int part, int count) {
    const int64_t begin = std::min(n, units * part / count * align), end = std::min(n, units * (part + 1) / count * align);
    if (begin < end) fn(begin, end);
  });
}

inline float f32(uint16_t bits) {
  uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f32(bf16 v) { return static_cast<float>(v); }

inline float f32(float v) { return v; }

// v rounded as storing it in T rounds it (bf16: to 8 bits of mantissa; float: unchanged)
template <typename T>
inline float rnd(float v) { return static_cast<float>(T(v)); }

// ---- one dot product per weight row: out[n] = sum_k w[n, k] * x[k] in fp32, rows n0 .. n1 - 1 ----

// M input rows at once (x rows x_stride apart; out[m * out_stride + n]): each weight row is read once for all M.
// Every (m, n) sum takes the same steps whatever M is (two chains over 64-element steps, then the tail), so a
// row's values do not depend on how many rows share the call.
template <int M>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dot_rows_avx512bf16(
    const uint16_t* w, const uint16_t* x, int64_t x_stride, float* out, int64_t out_stride, int64_t n0, int64_t n1,
    int64_t K) {
  const int64_t body = K - K % 64;
  const __mmask32 tail = K % 32 ? __mmask32((1u << (K % 32)) - 1) : __mmask32(0);
  const uint16_t* row = w + n0 * K;
  for (int64_t n = n0; n < n1; ++n, row += K) {
    __m512 a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < body; k += 64) {  // two chains; the next rows are fetched ahead (2 KB: a row or two)
      _mm_prefetch(reinterpret_cast<const char*>(row + k + 1024), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + k + 1056), _MM_HINT_T0);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k), w1 = (__m512bh)_mm512_loadu_si512(row + k + 32);
      for (int m = 0; m < M; ++m) {
        a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_loadu_si512(x + m * x_stride + k));
        a1[m] = _mm512_dpbf16_ps(a1[m], w1, (__m512bh)_mm512_loadu_si512(x + m * x_stride + k + 32));
      }
    }
    for (; k + 32 <= K; k += 32) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
      for (int m = 0; m < M; ++m)
        a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_loadu_si512(x + m * x_stride + k));
    }
    if (tail) {
      const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(tail, row + k);
      for (int m = 0; m < M; ++m)
        a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * x_stride + k));
    }
    for (int m = 0; m < M; ++m) out[m * out_stride + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
  }
}

// fn(std::integral_constant<int, M>, m) for the input rows m .. m + M - 1, eight at a time (the products' row
// counts are template arguments, so each count's accumulators stay in registers: 16 of the 32 at eight rows)
template <typename Fn>
void in_eights(int64_t rows, Fn&& fn) {
  using std::integral_constant;
  for (int64_t m = 0; m < rows; m += 8) {
    switch (std::min<int64_t>(8, rows - m)) {
      case 1: fn(integral_constant<int, 1>{}, m); break;
      case 2: fn(integral_constant<int, 2>{}, m); break;
      case 3: fn(integral_constant<int, 3>{}, m); break;
      case 4: fn(integral_constant<int, 4>{}, m); break;
      case 5: fn(integral_constant<int, 5>{}, m); break;
      case 6: fn(integral_constant<int, 6>{}, m); break;
      case 7: fn(integral_constant<int, 7>{}, m); break;
      default: fn(integral_constant<int, 8>{}, m); break;
    }
  }
}

void dot_rows_avx512bf16(const uint16_t* w, const uint16_t* x, int64_t x_stride, int64_t rows, float* out,
                         int64_t out_stride, int64_t n0, int64_t n1, int64_t K) {
  in_eights(rows, [&](auto M, int64_t m) {
    dot_rows_avx512bf16<decltype(M)::value>(w, x + m * x_stride, x_stride, out + m * out_stride, out_stride, n0, n1, K);
  });
}

// Elsewhere, and for fp32 weights: values widened to fp32 and multiplied-added in 16 lanes, vectorized per target
// by the compiler (the body is inlined into each target's clone).
template <typename E>  // uint16_t (bf16 bits) or float
inline void dot_rows(const E* w, const E* x, float* out, int64_t n0, int64_t n1, int64_t K) {
  for (int64_t n = n0; n < n1; ++n) {
    const E* row = w + n * K;
    float lanes[16] = {0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      for (int j = 0; j < 16; ++j) lanes[j] += f32(row[k + j]) * f32(x[k + j]);
    float acc = 0;
    for (; k < K; ++k) acc += f32(row[k]) * f32(x[k]);
    for (int j = 0; j < 16; ++j) acc += lanes[j];
    out[n] = acc;
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void dot_rows_generic(
    const uint16_t* w, const uint16_t* x, float* out, int64_t n0, int64_t n1, int64_t K) {
  dot_rows(w, x, out, n0, n1, K);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void dot_rows_f32(
    const float* w, const float* x, float* out, int64_t n0, int64_t n1, int64_t K) {
  dot_rows(w, x, out, n0, n1, K);
}

// e^x for x <= 0 (softmax's shifted scores) in plain arithmetic the compiler vectorizes: x = n ln2 + r,
// |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error < 2e-7), 2^n through the exponent bits;
// below -87 the result is 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// One query head over L keys: score[l] = scale * q . k_l (fp32), softmax as exp(s - max) / sum, acc = sum p v.
// k, v point at the head's columns of slot 0; rows are k_row / v_row elements apart.
template <typename E>
inline void attend(const float* q, const E* k, const E* v, int64_t k_row, int64_t v_row, const int64_t* slot,
                   int64_t L, int64_t D, float scale, float* score, float* acc) {
  float top = -INFINITY;
  for (int64_t l = 0; l < L; ++l) {
    const E* key = k + slot[l] * k_row;
    float lanes[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= D; j += 16)
      for (int t = 0; t < 16; ++t) lanes[t] += q[j + t] * f32(key[j + t]);
    for (int w = 8; w >= 1; w /= 2)  // the lanes summed as a tree (vector shuffles, not a chain of 16 adds)
      for (int t = 0; t < w; ++t) lanes[t] += lanes[t + w];
    float dot = lanes[0];
    for (; j < D; ++j) dot += q[j] * f32(key[j]);
    score[l] = dot * scale;
    top = std::max(top, score[l]);
  }
  float total = 0;
  for (int64_t l = 0; l < L; ++l) score[l] = exp_nonpositive(score[l] - top);
  for (int64_t l = 0; l < L; ++l) total += score[l];
  for (int64_t j = 0; j < D; ++j) acc[j] = 0;
  for (int64_t l = 0; l < L; ++l) {
    const E* val = v + slot[l] * v_row;
    const float p = score[l];
    for (int64_t j = 0; j < D; ++j) acc[j] += p * f32(val[j]);
  }
  const float inv = 1.0f / total;
  for (int64_t j = 0; j < D; ++j) acc[j] *= inv;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void attend_head(
    const float* q, const uint16_t* k, const uint16_t* v, int64_t k_row, int64_t v_row, const int64_t* slot,
    int64_t L, int64_t D, float scale, float* score, float* acc) {
  attend(q, k, v, k_row, v_row, slot, L, D, scale, score, acc);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void attend_head(
    const float* q, const float* k, const float* v, int64_t k_row, int64_t v_row, const int64_t* slot,
    int64_t L, int64_t D, float scale, float* score, float* acc) {
  attend(q, k, v, k_row, v_row, slot, L, D, scale, score, acc);
}

// ---- attention over long contexts: keys in chunks, each chunk one task for a kv head's whole group of q heads ----
//
// A row's keys are cut into chunks of kChunk at fixed places (0, kChunk, 2 kChunk, ... of its slot list); each
// (row, kv head, chunk) is a task that reads its keys and values once for every q head of the group and leaves,
// per q head, the chunk's max score m, sum of exp(score - m) and the unnormalized sum of exp(score - m) v. The
// chunks are then merged in order. The cut does not depend on the thread count or on the other rows, so neither
// does a row's result.
constexpr int64_t kChunk = 256;

// 16 vectors -> one vector of their 16 horizontal sums (v[i]'s sum in lane i)
__attribute__((target("avx512f"))) inline __m512 sums16(const __m512* v) {
  __m512 b[4];
  for (int q = 0; q < 4; ++q) {  // per quad: each 128-bit lane c holds lane c's sums of v[4q .. 4q + 3]
    const __m512* w = v + 4 * q;
    const __m512 a01 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
    const __m512 a23 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
    b[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a01), _mm512_castps_pd(a23))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a01), _mm512_castps_pd(a23))));
  }
  // sum the four 128-bit lanes of each b[q] into lanes 4q .. 4q + 3
  const __m512 c01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c01, c23, 0x88), _mm512_shuffle_f32x4(c01, c23, 0xDD));
}

// 16 values of a key or value row as fp32
__attribute__((target("avx512f,avx512bw"))) inline __m512 widen16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
__attribute__((target("avx512f"))) inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }

// q . key for one q head (D = 16 DV), as one vector whose lanes sum to it: bf16 keys through AVX512-BF16 pairs
// (q's values are bf16 values: the step rounds them), fp32 keys through fp32 products.
template <int DV>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m512 qk16(const uint16_t* qb, const float*,
                                                                           const uint16_t* key) {
  __m512 a = _mm512_setzero_ps();
  for (int j = 0; j < DV / 2; ++j)
    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(key + 32 * j), (__m512bh)_mm512_loadu_si512(qb + 32 * j));
  return a;
}
template <int DV>
__attribute__((target("avx512f"))) inline __m512 qk16(const uint16_t*, const float* q, const float* key) {
  __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(key));
  for (int j = 1; j < DV; ++j) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * j), _mm512_loadu_ps(key + 16 * j), a);
  return a;
}

// acc[h] += p[h][l] * value_l over the chunk's keys, for H q heads at once (H * DV accumulators in registers)
template <typename E, int DV, int H>
__attribute__((target("avx512f,avx512bw"))) void weighted_values(const E* v, int64_t v_row, const int64_t* slot,
                                                                 int64_t n, const float* p, int64_t p_stride,
                                                                 float* acc, int64_t D) {
  __m512 a[H][DV];
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < DV; ++j) a[h][j] = _mm512_setzero_ps();
  for (int64_t l = 0; l < n; ++l) {
    const E* row = v + slot[l] * v_row;
    __m512 x[DV];
    for (int j = 0; j < DV; ++j) x[j] = widen16(row + 16 * j);
    for (int h = 0; h < H; ++h) {
      const __m512 w = _mm512_set1_ps(p[h * p_stride + l]);
      for (int j = 0; j < DV; ++j) a[h][j] = _mm512_fmadd_ps(w, x[j], a[h][j]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < DV; ++j) _mm512_storeu_ps(acc + h * D + 16 * j, a[h][j]);
}

template <typename E, int DV>
__attribute__((target("avx512f,avx512bw"))) void weighted_values(const E* v, int64_t v_row, const int64_t* slot,
                                                                 int64_t n, const float* p, int64_t p_stride,
                                                                 float* acc, int64_t D, int G) {
  constexpr int kMost = DV <= 4 ? 3 : 1;  // heads a pass: their accumulators and one value row fit 32 registers
  for (int h = 0; h < G; h += kMost) {
    const float* ph = p + h * p_stride;
    float* ah = acc + h * D;
    switch (std::min(kMost, G - h)) {
      case 1: weighted_values<E, DV, 1>(v, v_row, slot, n, ph, p_stride, ah, D); break;
      case 2: weighted_values<E, DV, (kMost >= 2 ? 2 : 1)>(v, v_row, slot, n, ph, p_stride, ah, D); break;
      default: weighted_values<E, DV, kMost>(v, v_row, slot, n, ph, p_stride, ah, D); break;
    }
  }
}

// One chunk of n <= kChunk keys for the G q heads of a kv head: per head h, out_m[h] = max score, out_s[h] = sum of
// exp(score - max), out_acc[h] (D) = sum of exp(score - max) * value. q: G rows of D values (T); qf the same in fp32.
template <typename E, int DV>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void attend_chunk_avx512(
    const E* q, const float* qf, const E* k, const E* v, int64_t k_row, int64_t v_row, const int64_t* slot,
    int64_t n, int G, float scale, float* score, float* out_m, float* out_s, float* out_acc) {
  constexpr int64_t D = 16 * DV;
  for (int64_t l0 = 0; l0 < n; l0 += 16) {  // scores, 16 keys a block, their sums reduced together
    const int64_t count = std::min<int64_t>(16, n - l0);
    for (int h = 0; h < G; ++h) {
      __m512 dots[16];
      for (int64_t i = 0; i < 16; ++i)
        dots[i] = i < count ? qk16<DV>(reinterpret_cast<const uint16_t*>(q + h * D), qf + h * D,
                                       k + slot[l0 + i] * k_row)
                            : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(score + h * kChunk + l0, __mmask16((1u << count) - 1),
                            _mm512_mul_ps(sums16(dots), _mm512_set1_ps(scale)));
    }
  }
  for (int h = 0; h < G; ++h) {
    float* sh = score + h * kChunk;
    float top = -INFINITY;
    for (int64_t l = 0; l < n; ++l) top = std::max(top, sh[l]);
    float total = 0;
    for (int64_t l = 0; l < n; ++l) sh[l] = exp_nonpositive(sh[l] - top);
    for (int64_t l = 0; l < n; ++l) total += sh[l];
    out_m[h] = top;
    out_s[h] = total;
  }
  weighted_values<E, DV>(v, v_row, slot, n, score, kChunk, out_acc, D, G);
}

template <typename E>
void attend_chunk(const E* q, const float* qf, const E* k, const E* v, int64_t k_row, int64_t v_row,
                  const int64_t* slot, int64_t n, int64_t D, int G, float scale, float* score, float* m, float* s,
                  float* acc) {
  switch (D) {
    case 32: attend_chunk_avx512<E, 2>(q, qf, k, v, k_row, v_row, slot, n, G, scale, score, m, s, acc); break;
    case 64: attend_chunk_avx512<E, 4>(q, qf, k, v, k_row, v_row, slot, n, G, scale, score, m, s, acc); break;
    default: attend_chunk_avx512<E, 8>(q, qf, k, v, k_row, v_row, slot, n, G, scale, score, m, s, acc); break;
  }
}

// the element type the loops read: bf16 as its bits
inline const uint16_t* elements(const bf16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline const float* elements(const float* p) { return p; }

bool& use_avx512bf16() {  // the CPU's AVX512-BF16 dot products where it has them; tests switch them off
  static bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}

// Whether the hand-written AVX512 paths (AVX512-BF16 products, the chunked attention) run from now on (only where
// the CPU has AVX512-BF16); returns the previous setting. Off, everything takes the portable loops.
bool set_native_bf16(bool enabled) {
  const bool previous = use_avx512bf16();
  use_avx512bf16() = enabled && __builtin_cpu_supports("avx512bf16");
  return previous;
}

// The chunked attention applies where the hand-written loops do (a CPU with AVX512-BF16; its fp32 form uses
// AVX512F alone), for head sizes of 32, 64 or 128.
bool chunked_attention_applies(int64_t D) { return use_avx512bf16() && (D == 32 || D == 64 || D == 128); }

constexpr int64_t kBlockRows = 16;

// out (M, N) fp32 <- x (M, K) @ w (N, K)^T, weight rows split over the workers (M = 1: a lone row)
void gemv_into(const bf16* x, const bf16* w, float* out, int64_t N, int64_t K, int64_t M = 1) {
  const int64_t rows = std::max<int64_t>(16, (1 << 14) / std::max<int64_t>(K, 1));  // >= ~32 KB of weight a part
  parallel_ranges(N, 4, rows, [&](int64_t n0, int64_t n1) {
    if (use_avx512bf16()) {
      dot_rows_avx512bf16(elements(w), elements(x), K, M, out, N, n0, n1, K);
    } else {
      for (int64_t b = n0; b < n1; b += kBlockRows)  // a block of weight rows stays in cache across the M inputs
        for (int64_t m = 0; m < M; ++m)
          dot_rows_generic(elements(w), elements(x) + m * K, out + m * N, b, std::min(n1, b + kBlockRows), K);
    }
  });
}

void gemv_into(const float* x, const float* w, float* out, int64_t N, int64_t K, int64_t M = 1) {
  const int64_t rows = std::max<int64_t>(8, (1 << 13) / std::max<int64_t>(K, 1));
  parallel_ranges(N, 4, rows, [&](int64_t n0, int64_t n1) {
    for (int64_t b = n0; b < n1; b += kBlockRows)  // a block of weight rows stays in cache across the M inputs
      for (int64_t m = 0; m < M; ++m) dot_rows_f32(w, x + m * K, out + m * N, b, std::min(n1, b + kBlockRows), K);
  });
}

// ---- 4-bit weights (GGUF's Q4_1 blocks) ----
//
// A Q4_1 weight row is K / 32 blocks; block g holds 32 codes q in 0..15, packed as GGUF packs them (byte j: q[j] in
// the low nibble, q[j + 16] in the high one), and stands for d_g * q + m_g. The products take d_g and
// c_g = m_g - 16 d_g in fp32 (made at load) and compute
//     y = sum_g d_g * S_g + c_g * X_g,   S_g = sum_j (16 + q_j) x_j,   X_g = sum_j x_j
// which is sum_g sum_j (d_g q_j + m_g) x_j: with AVX512-BF16 each block's codes become the bf16 values 16 + q
// (exact: the bits 0x4180 | q << 3) and S_g is one dot-product instruction against the block's 32 bf16 inputs.
struct Mat {
  const void* dense = nullptr;     // (N, K) of the activations' type
  const uint8_t* codes = nullptr;  // Q4_1: (N, K / 2) packed codes
  const float* d = nullptr;        // Q4_1: (N, K / 32) scales
  const float* c = nullptr;        // Q4_1: (N, K / 32) m - 16 d
  const int8_t* q8 = nullptr;      // int8 rows: (N, K), each row times its scale d[n]
  int64_t N = 0, K = 0;
};

constexpr int64_t kGroup = 32;

// x (M, K) -> the block sums X (M, K / 32) in fp32
template <typename T>
void block_sums(const T* x, float* out, int64_t M, int64_t K) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / kGroup; ++g) {
      float s = 0;
      for (int64_t j = 0; j < kGroup; ++j) s += f32(x[m * K + g * kGroup + j]);
      out[m * (K / kGroup) + g] = s;
    }
}

// sum_g c_g X_g for one weight row and one input row, 16 blocks a step
__attribute__((target("avx512f"))) inline float offsets_avx512(const float* c, const float* xsum, int64_t G) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 take = G - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (G - g)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(take, c + g), _mm512_maskz_loadu_ps(take, xsum + g), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

template <int M>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void q4_rows_avx512bf16(
    const Mat& w, const uint16_t* x, const float* xsum, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  const int64_t K = w.K, G = K / kGroup;
  const __m512i base = _mm512_set1_epi16(0x4180);  // bf16 16.0: the code q lands in the mantissa's top bits
  const __m512i mask = _mm512_set1_epi16(0x78);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.codes + n * (K / 2);
    const float* d = w.d + n * G;
    __m512 a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {  // blocks alternate between two chains
      if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + g * 16 + 768), _MM_HINT_T0);
      // the block's 16 bytes as 16-bit words b; q[j] << 3 = (b << 3) & 0x78, q[j + 16] << 3 = (b >> 1) & 0x78
      const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16)));
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_slli_epi16(b, 3)), _mm256_srli_epi16(b, 1), 1);
      const __m512bh wq = (__m512bh)_mm512_ternarylogic_epi32(both, mask, base, 0xEA);  // (both & mask) | base
      const __m512 dg = _mm512_set1_ps(d[g]);
      for (int m = 0; m < M; ++m) {
        const __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), wq,
                                          (__m512bh)_mm512_loadu_si512(x + m * K + g * kGroup));
        if (g & 1)
          a1[m] = _mm512_fmadd_ps(dg, s, a1[m]);
        else
          a0[m] = _mm512_fmadd_ps(dg, s, a0[m]);
      }
    }
    for (int m = 0; m < M; ++m)
      out[m * out_stride + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m])) +
                                offsets_avx512(w.c + n * G, xsum + m * G, G);
  }
}

void q4_rows_avx512bf16(const Mat& w, const uint16_t* x, const float* xsum, int64_t rows, float* out,
                        int64_t out_stride, int64_t n0, int64_t n1) {
  const int64_t K = w.K, G = K / kGroup;
  in_eights(rows, [&](auto M, int64_t m) {  // each block's codes widened once for the eight rows
    q4_rows_avx512bf16<decltype(M)::value>(w, x + m * K, xsum + m * G, out + m * out_stride, out_stride, n0, n1);
  });
}

// Elsewhere, and for fp32 activations: the same sums in 16 fp32 lanes, vectorized per target by the compiler.
template <typename E>
inline void q4_rows(const Mat& w, const E* x, const float* xsum, float* out, int64_t n0, int64_t n1) {
  const int64_t K = w.K, G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.codes + n * (K / 2);
    const float* d = w.d + n * G;
    const float* c = w.c + n * G;
    float acc[16] = {0};
    float offsets = 0;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = row + g * 16;
      const E* xg = x + g * kGroup;
      for (int j = 0; j < 16; ++j)
        acc[j] += d[g] * (float(16 + (b[j] & 15)) * f32(xg[j]) + float(16 + (b[j] >> 4)) * f32(xg[16 + j]));
      offsets += c[g] * xsum[g];
    }
    for (int w = 8; w >= 1; w /= 2)
      for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
    out[n] = acc[0] + offsets;
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void q4_rows_generic(
    const Mat& w, const uint16_t* x, const float* xsum, float* out, int64_t n0, int64_t n1) {
  q4_rows(w, x, xsum, out, n0, n1);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void q4_rows_f32(
    const Mat& w, const float* x, const float* xsum, float* out, int64_t n0, int64_t n1) {
  q4_rows(w, x, xsum, out, n0, n1);
}

// out (M, N) fp32 <- x (M, K) times the Q4_1 weight w, weight rows split over the workers
template <typename T>
void q4_into(const T* x, const Mat& w, float* out, int64_t M) {
  const int64_t N = w.N, K = w.K, G = K / kGroup;
  std::vector<float> xsum(M * G);
  block_sums(x, xsum.data(), M, K);
  const int64_t rows = std::max<int64_t>(16, (1 << 15) / std::max<int64_t>(K, 1));  // >= ~16 KB of codes a part
  parallel_ranges(N, 4, rows, [&](int64_t n0, int64_t n1) {
    if constexpr (std::is_same_v<T, bf16>) {
      if (use_avx512bf16()) {
        q4_rows_avx512bf16(w, elements(x), xsum.data(), M, out, N, n0, n1);
        return;
      }
    }
    for (int64_t b = n0; b < n1; b += kBlockRows)  // a block of weight rows stays in cache across the M inputs
      for (int64_t m = 0; m < M; ++m) {
        if constexpr (std::is_same_v<T, bf16>)
          q4_rows_generic(w, elements(x) + m * K, xsum.data() + m * G, out + m * N, b, std::min(n1, b + kBlockRows));
        else
          q4_rows_f32(w, x + m * K, xsum.data() + m * G, out + m * N, b, std::min(n1, b + kBlockRows));
      }
  });
}

// ---- int8 rows (quantization="int8": per output row symmetric int8, layers/int8.py) ----
// out[m, n] = d[n] * sum_k q[n, k] x[m, k], the inputs widened to fp32 once and the codes to fp32 as they stream.
template <int M>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void int8_rows_avx512(const Mat& w, const float* x, float* out,
                                                                           int64_t out_stride, int64_t n0, int64_t n1) {
  const int64_t K = w.K, body = K - K % 32;
  const __mmask16 tail = K % 16 ? __mmask16((1u << (K % 16)) - 1) : __mmask16(0);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w.q8 + n * K;
    __m512 a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < body; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(row + k + 1024), _MM_HINT_T0);
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k))));
      const __m512 w1 =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16))));
      for (int m = 0; m < M; ++m) {
        a0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), a0[m]);
        a1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + k + 16), a1[m]);
      }
    }
    for (; k + 16 <= K; k += 16) {
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k))));
      for (int m = 0; m < M; ++m) a0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), a0[m]);
    }
    if (tail) {
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail, row + k)));
      for (int m = 0; m < M; ++m) a0[m] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(tail, x + m * K + k), a0[m]);
    }
    for (int m = 0; m < M; ++m) out[m * out_stride + n] = w.d[n] * _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
  }
}

void int8_rows_avx512(const Mat& w, const float* x, int64_t rows, float* out, int64_t out_stride, int64_t n0,
                      int64_t n1) {
  in_eights(rows, [&](auto M, int64_t m) {
    int8_rows_avx512<decltype(M)::value>(w, x + m * w.K, out + m * out_stride, out_stride, n0, n1);
  });
}

// Elsewhere: 16 fp32 lanes per row, vectorized per target by the compiler.
__attribute__((target_clones("avx512f", "avx2", "default"))) void int8_rows_generic(
    const Mat& w, const float* x, float* out, int64_t n0, int64_t n1) {
  const int64_t K = w.K;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w.q8 + n * K;
    float lanes[16] = {0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      for (int j = 0; j < 16; ++j) lanes[j] += float(row[k + j]) * x[k + j];
    float rest = 0;
    for (; k < K; ++k) rest += float(row[k]) * x[k];
    for (int h = 8; h >= 1; h /= 2)
      for (int j = 0; j < h; ++j) lanes[j] += lanes[j + h];
    out[n] = w.d[n] * (lanes[0] + rest);
  }
}

template <typename T>
void int8_into(const T* x, const Mat& w, float* out, int64_t M) {
  const int64_t N = w.N, K = w.K;
  std::vector<float> widened;
  const float* xf;
  if constexpr (std::is_same_v<T, float>) {
    xf = x;
  } else {
    widened.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) widened[i] = f32(x[i]);
    xf = widened.data();
  }
  const int64_t rows = std::max<int64_t>(16, (1 << 15) / std::max<int64_t>(K, 1));  // >= ~32 KB of codes a part
  parallel_ranges(N, 4, rows, [&](int64_t n0, int64_t n1) {
    if (use_avx512bf16()) {
      int8_rows_avx512(w, xf, M, out, N, n0, n1);
      return;
    }
    for (int64_t b = n0; b < n1; b += kBlockRows)
      for (int64_t m = 0; m < M; ++m) int8_rows_generic(w, xf + m * K, out + m * N, b, std::min(n1, b + kBlockRows));
  });
}

// out (M, N) <- x (M, K) @ w^T for a dense, Q4_1 or int8 weight
template <typename T>
void product(const T* x, const Mat& w, float* out, int64_t M) {
  if (w.codes != nullptr)
    q4_into(x, w, out, M);
  else if (w.q8 != nullptr)
    int8_into(x, w, out, M);
  else
    gemv_into(x, static_cast<const T*>(w.dense), out, w.N, w.K, M);
}

bool is_16_or_32(at::ScalarType t) { return t == at::kBFloat16 || t == at::kFloat; }

void check_matrix(const at::Tensor& w, at::ScalarType dtype, int64_t K, const char* what) {
  TORCH_CHECK(w.scalar_type() == dtype && w.dim() == 2 && w.is_contiguous() && w.size(1) == K,
              what, ": a contiguous ", dtype, " (N, ", K, ") weight expected, got ", w.scalar_type(), " ", w.sizes());
}

void check_vector(const at::Tensor& v, at::ScalarType dtype, int64_t n, const char* what) {
  TORCH_CHECK(v.scalar_type() == dtype && v.dim() == 1 && v.is_contiguous() && v.size(0) == n,
              what, ": a contiguous ", dtype, " vector of ", n, " expected, got ", v.scalar_type(), " ", v.sizes());
}

// x (K,) or (M, K) and w (N, K), both bf16 or both fp32 -> (N,) or (M, N) fp32 sums; bf16_out: rounded to bf16
// (bf16 inputs only). A row's values are the same whatever M is.
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, bool bf16_out) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "deepinfer_cpu::gemv: CPU tensors expected");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(is_16_or_32(dtype), "deepinfer_cpu::gemv: bf16 or fp32 values expected, got ", dtype);
  TORCH_CHECK(!bf16_out || dtype == at::kBFloat16, "deepinfer_cpu::gemv: bf16_out takes bf16 inputs");
  TORCH_CHECK((x.dim() == 1 || x.dim() == 2) && x.is_contiguous(),
              "deepinfer_cpu::gemv x: a contiguous (K,) or (M, K) input expected, got ", x.sizes());
  const int64_t K = x.size(-1), M = x.dim() == 2 ? x.size(0) : 1;
  check_matrix(w, dtype, K, "deepinfer_cpu::gemv w");
  auto out = at::empty(x.dim() == 2 ? std::vector<int64_t>{M, w.size(0)} : std::vector<int64_t>{w.size(0)},
                       x.options().dtype(at::kFloat));
  if (M > 0 && dtype == at::kBFloat16)
    gemv_into(x.data_ptr<bf16>(), w.data_ptr<bf16>(), out.data_ptr<float>(), w.size(0), K, M);
  else if (M > 0)
    gemv_into(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), w.size(0), K, M);
  return bf16_out ? out.to(at::kBFloat16) : out;
}

// RMSNorm as the eager step computes it: fp32 values times rsqrt(mean(x^2) + eps), rounded to T, then times the
// weight, rounded to T.
template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t n, float eps) {
  float sq = 0;
  for (int64_t i = 0; i < n; ++i) sq += f32(x[i]) * f32(x[i]);
  const float inv = 1.0f / std::sqrt(sq / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = T(rnd<T>(f32(x[i]) * inv) * f32(weight[i]));
}

template <typename T>
void layer(at::Tensor& x, at::Tensor& residual, bool first, const at::Tensor& in_norm, const at::Tensor& post_norm,
           const Mat& qkv_w, const Mat& o_w, const Mat& gate_up_w, const Mat& down_w, const at::Tensor& cos, const at::Tensor& signed_sin, at::Tensor& k_cache, at::Tensor& v_cache,
           const int64_t* slot, const int64_t* start, const int64_t* out_slot, int64_t B, int64_t num_q,
           int64_t num_kv, float eps, float scale) {
  const int64_t H = x.size(1), D = cos.size(1), half = D / 2, heads = num_q + 2 * num_kv, width = heads * D;
  const int64_t inter = down_w.K;
  T* xs = x.data_ptr<T>();
  T* rs = residual.data_ptr<T>();
  std::vector<T> h(B * std::max(H, inter));
  std::vector<float> sums(B * std::max(width, 2 * inter));
  std::vector<T> qkv(B * width), attn(B * num_q * D);

  for (int64_t b = 0; b < B; ++b) {
    T* xp = xs + b * H;
    T* rp = rs + b * H;
    for (int64_t i = 0; i < H; ++i) rp[i] = first ? xp[i] : T(f32(xp[i]) + f32(rp[i]));
    rms_norm(rp, in_norm.data_ptr<T>(), h.data() + b * H, H, eps);
  }
  product(h.data(), qkv_w, sums.data(), B);
  for (int64_t i = 0; i < B * width; ++i) qkv[i] = T(sums[i]);

  // rotary on the q and k heads: x * cos + (x2 | x1) * (-sin | sin), each product and the sum rounded
  std::vector<T> head(D);
  for (int64_t b = 0; b < B; ++b) {
    const T* c = cos.data_ptr<T>() + b * D;
    const T* s = signed_sin.data_ptr<T>() + b * D;
    for (int64_t hd = 0; hd < num_q + num_kv; ++hd) {
      T* v = qkv.data() + b * width + hd * D;
      std::copy(v, v + D, head.begin());
      for (int64_t j = 0; j < D; ++j) {
        const float swapped = f32(head[(j + half) % D]);
        v[j] = T(rnd<T>(f32(head[j]) * f32(c[j])) + rnd<T>(swapped * f32(s[j])));
      }
    }
  }

  // store the new k and v
  const int64_t k_row = k_cache.stride(0), v_row = v_cache.stride(0);
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  for (int64_t b = 0; b < B; ++b) {
    const T* row = qkv.data() + b * width;
    std::copy(row + num_q * D, row + (num_q + num_kv) * D, kc + out_slot[b] * k_row);
    std::copy(row + (num_q + num_kv) * D, row + width, vc + out_slot[b] * v_row);
  }

  const int64_t group = num_q / num_kv;
  if (chunked_attention_applies(D)) {  // tasks (row, kv head, chunk of kChunk keys), then the chunks merged
    std::vector<int64_t> first_task(B + 1, 0);
    for (int64_t b = 0; b < B; ++b)
      first_task[b + 1] = first_task[b] + num_kv * ((start[b + 1] - start[b] + kChunk - 1) / kChunk);
    const int64_t tasks = first_task[B], per_task = group * (D + 2);  // per q head: m, s, acc (D)
    std::vector<float> partial(tasks * per_task);
    parallel_ranges(tasks, 1, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> score(group * kChunk);
      int64_t b = int64_t(std::upper_bound(first_task.begin(), first_task.end(), t0) - first_task.begin()) - 1;
      for (int64_t t = t0; t < t1; ++t) {
        while (t >= first_task[b + 1]) ++b;
        const int64_t chunks = (first_task[b + 1] - first_task[b]) / num_kv, i = t - first_task[b];
        const int64_t g = i / chunks, c = i % chunks, l0 = c * kChunk;
        const int64_t n = std::min(kChunk, start[b + 1] - start[b] - l0);
        const T* q = qkv.data() + b * width + g * group * D;
        float* out = partial.data() + t * per_task;
        attend_chunk(elements(q), reinterpret_cast<const float*>(q), elements(kc) + g * D, elements(vc) + g * D,
                     k_row, v_row, slot + start[b] + l0, n, D, int(group), scale, score.data(), out, out + group,
                     out + 2 * group);
      }
    });
    parallel_ranges(B * num_q, 1, 8, [&](int64_t p0, int64_t p1) {  // merge each q head's chunks in order
      std::vector<float> acc(D);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = p / num_q, hq = p % num_q, g = hq / group, h = hq % group;
        const int64_t chunks = (first_task[b + 1] - first_task[b]) / num_kv;
        const float* part = partial.data() + (first_task[b] + g * chunks) * per_task;
        float top = -INFINITY;
        for (int64_t c = 0; c < chunks; ++c) top = std::max(top, part[c * per_task + h]);
        float total = 0;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t c = 0; c < chunks; ++c) {
          const float* pc = part + c * per_task;
          const float w = chunks == 1 ? 1.0f : exp_nonpositive(pc[h] - top);
          total += w * pc[group + h];
          const float* a = pc + 2 * group + h * D;
          for (int64_t j = 0; j < D; ++j) acc[j] += w * a[j];
        }
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < D; ++j) attn[(b * num_q + hq) * D + j] = T(acc[j] * inv);
      }
    });
  } else {  // attention per (row, q head) over that row's keys (attend_head)
    parallel_ranges(B * num_q, 1, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> score, q(D), acc(D);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = p / num_q, hq = p % num_q, g = hq / group, L = start[b + 1] - start[b];
        score.resize(L);
        for (int64_t j = 0; j < D; ++j) q[j] = f32(qkv[b * width + hq * D + j]);
        attend_head(q.data(), elements(kc) + g * D, elements(vc) + g * D, k_row, v_row, slot + start[b], L, D,
                    scale, score.data(), acc.data());
        for (int64_t j = 0; j < D; ++j) attn[(b * num_q + hq) * D + j] = T(acc[j]);
      }
    });
  }

  product(attn.data(), o_w, sums.data(), B);
  for (int64_t b = 0; b < B; ++b) {
    T* rp = rs + b * H;
    for (int64_t i = 0; i < H; ++i) rp[i] = T(rnd<T>(sums[b * H + i]) + f32(rp[i]));
    rms_norm(rp, post_norm.data_ptr<T>(), h.data() + b * H, H, eps);
  }
  product(h.data(), gate_up_w, sums.data(), B);
  for (int64_t b = 0; b < B; ++b) {
    const float* gu = sums.data() + b * 2 * inter;
    for (int64_t i = 0; i < inter; ++i) {  // SiLU on the gate (fp32, rounded), times up (rounded)
      const float gate = rnd<T>(gu[i]), up = rnd<T>(gu[inter + i]);
      h[b * inter + i] = T(rnd<T>(gate / (1.0f + std::exp(-gate))) * up);
    }
  }
  product(h.data(), down_w, sums.data(), B);
  for (int64_t i = 0; i < B * H; ++i) xs[i] = T(sums[i]);
}

void check_rows(const at::Tensor& v, at::ScalarType dtype, int64_t B, int64_t n, const char* what) {
  TORCH_CHECK(v.scalar_type() == dtype && v.dim() == 2 && v.is_contiguous() && v.size(0) == B && v.size(1) == n,
              what, ": contiguous ", dtype, " rows (", B, ", ", n, ") expected, got ", v.scalar_type(), " ",
              v.sizes());
}

// ---- attention of a many-token step (prefill, mixed steps): bf16, causal, each sequence's keys at its slots ----
//
// Per (sequence, kv head) the keys are packed once in pairs along D (Kp[block of 16 keys][pair p][key] = the key's
// elements 2p, 2p + 1 as one 32-bit word), so that one AVX512-BF16 instruction adds a query pair's products for 16
// keys into 16 lanes with no horizontal sums, and the values are widened to fp32 once. A task is a kv head and a tile
// of kQTile query positions, for all the group's q heads: its scores (fp32) for the keys its last position sees,
// the causal mask, an exact softmax per row (one max, one sum), and the values weighted in fp32.
constexpr int64_t kQTile = 16;

// scores of R query rows (q pairs as 32-bit words, rows q_stride words apart) against KB blocks of 16 keys
template <int R, int KB>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void qk_tile(const uint32_t* q, int64_t q_stride,
                                                                     const uint32_t* kp, int64_t pairs, float scale,
                                                                     float* s, int64_t s_stride) {
  __m512 acc[R][KB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < KB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh k[KB];
    for (int b = 0; b < KB; ++b) k[b] = (__m512bh)_mm512_loadu_si512(kp + (b * pairs + p) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh qr = (__m512bh)_mm512_set1_epi32(int(q[r * q_stride + p]));
      for (int b = 0; b < KB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], k[b], qr);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < KB; ++b) _mm512_storeu_ps(s + r * s_stride + 16 * b, _mm512_mul_ps(acc[r][b], sc));
}

// out[r] (D = 16 DV fp32) = sum over keys l < n[r] of p[r][l] * v[l], R rows at once: p as bf16 pairs of keys
// (32-bit words), v packed in the same pairs (vp[key pair][d] = v[2 lp][d], v[2 lp + 1][d]), one AVX512-BF16
// instruction a pair of keys and 16 of the head's elements
template <int R, int DV>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void pv_tile(const uint32_t* p, int64_t p_stride,
                                                                     const int64_t* n, const uint32_t* vp, float* out,
                                                                     int64_t out_stride) {
  constexpr int64_t D = 16 * DV;
  __m512 acc[R][DV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < DV; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t most = 0;
  for (int r = 0; r < R; ++r) most = std::max(most, n[r]);
  for (int64_t lp = 0; lp < (most + 1) / 2; ++lp) {  // rows past their own keys add p = 0 (their masked scores)
    __m512bh x[DV];
    for (int j = 0; j < DV; ++j) x[j] = (__m512bh)_mm512_loadu_si512(vp + lp * D + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int(p[r * p_stride + lp]));
      for (int j = 0; j < DV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x[j], w);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < DV; ++j) _mm512_storeu_ps(out + r * out_stride + 16 * j, acc[r][j]);
}

// exp_nonpositive on 16 lanes
__attribute__((target("avx512f"))) inline __m512 exp16_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// one row's softmax over its n scores (of `width`): exp(s - max) in place, 0 past n; returns the sum
__attribute__((target("avx512f,avx512bw"))) float softmax_row(float* s, int64_t n, int64_t width) {
  __m512 most = _mm512_set1_ps(-INFINITY);
  for (int64_t l = 0; l < n; l += 16) {
    const __mmask16 take = n - l >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - l)) - 1);
    most = _mm512_mask_max_ps(most, take, most, _mm512_maskz_loadu_ps(take, s + l));
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(most));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t l = 0; l < width; l += 16) {  // width: a multiple of 16; past n, 0
    const __mmask16 take = n - l >= 16 ? __mmask16(0xFFFF) : n > l ? __mmask16((1u << (n - l)) - 1) : __mmask16(0);
    const __m512 e = _mm512_maskz_mov_ps(take, exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(take, s + l), top)));
    _mm512_storeu_ps(s + l, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// n (a multiple of 16) fp32 values rounded to bf16 (to nearest even), 16 an instruction
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void to_bf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
}

template <int DV>
void prefill_sequence(const bf16* q, int64_t q_row, int64_t num_q, const bf16* kc, const bf16* vc, int64_t k_row,
                      int64_t v_row, const int64_t* slot, int64_t L, int64_t Q, int64_t num_kv, float scale,
                      bf16* out) {
  constexpr int64_t D = 16 * DV, pairs = D / 2;
  const int64_t group = num_q / num_kv, blocks = (L + 15) / 16, offset = L - Q;
  std::vector<uint32_t> kp(num_kv * blocks * pairs * 16), vp(num_kv * blocks * 8 * D);
  parallel_ranges(num_kv * blocks, 1, 4, [&](int64_t t0, int64_t t1) {  // pack: keys in pairs, values widened
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / blocks, b = t % blocks;
      uint32_t* kb = kp.data() + t * pairs * 16;
      uint16_t* vb = reinterpret_cast<uint16_t*>(vp.data() + (g * blocks + b) * 8 * D);  // 8 key pairs x D
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t l = b * 16 + i;
        if (l >= L) {
          for (int64_t p = 0; p < pairs; ++p) kb[p * 16 + i] = 0;
          for (int64_t d = 0; d < D; ++d) vb[((i / 2) * D + d) * 2 + i % 2] = 0;
          continue;
        }
        const uint32_t* key = reinterpret_cast<const uint32_t*>(kc + slot[l] * k_row + g * D);
        for (int64_t p = 0; p < pairs; ++p) kb[p * 16 + i] = key[p];
        const uint16_t* val = reinterpret_cast<const uint16_t*>(vc + slot[l] * v_row + g * D);
        for (int64_t d = 0; d < D; ++d) vb[((i / 2) * D + d) * 2 + i % 2] = val[d];
      }
    }
  });
  const int64_t tiles = (Q + kQTile - 1) / kQTile, tasks = num_kv * tiles;
  const int parts = int(std::min<int64_t>(at::get_num_threads(), tasks));
  workers()->run(parts, [&](int part, int count) {  // tasks dealt round robin: the causal tiles' sizes balance
    std::vector<uint32_t> qbuf(group * kQTile * pairs), pb;
    std::vector<float> sc, o(group * kQTile * D);
    std::vector<int64_t> n(group * kQTile);
    for (int64_t t = part; t < tasks; t += count) {
      const int64_t g = t % num_kv, j0 = t / num_kv * kQTile, j1 = std::min(Q, j0 + kQTile);
      const int64_t rows = (j1 - j0) * group, keys = offset + j1, width = (keys + 15) / 16 * 16;
      for (int64_t j = j0; j < j1; ++j)  // row r = (position - j0) * group + head in group
        for (int64_t h = 0; h < group; ++h) {
          const int64_t r = (j - j0) * group + h;
          std::memcpy(qbuf.data() + r * pairs, q + j * q_row + (g * group + h) * D, D * sizeof(bf16));
          n[r] = offset + j + 1;
        }
      sc.resize(rows * width);
      const uint32_t* kg = kp.data() + g * blocks * pairs * 16;
      for (int64_t r = 0; r < rows; r += 4)
        for (int64_t b = 0; b < width / 16; b += 2) {
          const uint32_t* qr = qbuf.data() + r * pairs;
          const uint32_t* kb = kg + b * pairs * 16;
          float* sr = sc.data() + r * width + b * 16;
          const int rr = int(std::min<int64_t>(4, rows - r)), bb = int(std::min<int64_t>(2, width / 16 - b));
          switch (rr * 2 + bb - 3) {  // (rows, blocks): (1,1) .. (4,2)
            case 0: qk_tile<1, 1>(qr, pairs, kb, pairs, scale, sr, width); break;
            case 1: qk_tile<1, 2>(qr, pairs, kb, pairs, scale, sr, width); break;
            case 2: qk_tile<2, 1>(qr, pairs, kb, pairs, scale, sr, width); break;
            case 3: qk_tile<2, 2>(qr, pairs, kb, pairs, scale, sr, width); break;
            case 4: qk_tile<3, 1>(qr, pairs, kb, pairs, scale, sr, width); break;
            case 5: qk_tile<3, 2>(qr, pairs, kb, pairs, scale, sr, width); break;
            case 6: qk_tile<4, 1>(qr, pairs, kb, pairs, scale, sr, width); break;
            default: qk_tile<4, 2>(qr, pairs, kb, pairs, scale, sr, width); break;
          }
        }
      std::vector<float> total(rows);
      pb.resize(rows * width / 2);
      for (int64_t r = 0; r < rows; ++r) {  // the weights as bf16 pairs of keys (their sum kept in fp32)
        total[r] = softmax_row(sc.data() + r * width, n[r], width);
        to_bf16(sc.data() + r * width, width, reinterpret_cast<uint16_t*>(pb.data() + r * width / 2));
      }
      const uint32_t* vg = vp.data() + g * blocks * 8 * D;
      constexpr int kRows = DV <= 4 ? 4 : 2;  // accumulators: rows x DV vectors of the 32 registers
      for (int64_t r = 0; r < rows; r += kRows) {
        const uint32_t* pr = pb.data() + r * width / 2;
        switch (std::min<int64_t>(kRows, rows - r)) {
          case 1: pv_tile<1, DV>(pr, width / 2, n.data() + r, vg, o.data() + r * D, D); break;
          case 2: pv_tile<(kRows >= 2 ? 2 : 1), DV>(pr, width / 2, n.data() + r, vg, o.data() + r * D, D); break;
          case 3: pv_tile<(kRows >= 3 ? 3 : 1), DV>(pr, width / 2, n.data() + r, vg, o.data() + r * D, D); break;
          default: pv_tile<kRows, DV>(pr, width / 2, n.data() + r, vg, o.data() + r * D, D); break;
        }
      }
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t h = 0; h < group; ++h) {
          const int64_t r = (j - j0) * group + h;
          const float inv = 1.0f / total[r];
          bf16* dst = out + (j * num_q + g * group + h) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = bf16(o[r * D + d] * inv);
        }
    }
  });
}

// Attention of a step's query rows, each sequence causal over its keys: q (T, Hq, D) bf16 (rows any stride), the
// layer's pool k_cache, v_cache (S, Hkv, D) bf16 holding every key already (the step's own written first); sequence
// i's keys are slots[seq_starts[i] : seq_starts[i + 1]], its q_lens[i] queries the next rows of q, the last keys'.
// -> (T, Hq, D) bf16. Head sizes 64 and 128, on a CPU with AVX512-BF16 (prefill_attention_applies).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& slots, const at::Tensor& seq_starts, const at::Tensor& q_lens,
                             double scale) {
  TORCH_CHECK(use_avx512bf16(), "prefill_attention: this CPU has no AVX512-BF16 (or it is switched off)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "prefill_attention: q (T, Hq, D) bf16 with each row's heads contiguous expected, got ",
              q.scalar_type(), " ", q.sizes(), " strides ", q.strides());
  const int64_t T = q.size(0), num_q = q.size(1), D = q.size(2);
  TORCH_CHECK(D == 64 || D == 128, "prefill_attention: head size 64 or 128 expected, got ", D);
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->scalar_type() == at::kBFloat16 && c->dim() == 3 && c->size(2) == D && c->stride(2) == 1 &&
                    c->stride(1) == D,
                "prefill_attention: kv cache bf16 (S, Hkv, ", D, ") rows expected, got ", c->scalar_type(), " ",
                c->sizes());
  const int64_t num_kv = k_cache.size(1), S = k_cache.size(0);
  TORCH_CHECK(v_cache.size(1) == num_kv && num_kv > 0 && num_q % num_kv == 0,
              "prefill_attention: q heads a multiple of kv heads expected");
  for (const at::Tensor* t : {&slots, &seq_starts, &q_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "prefill_attention: slots, seq_starts, q_lens: contiguous int64 vectors expected");
  const int64_t seqs = q_lens.numel();
  TORCH_CHECK(seq_starts.numel() == seqs + 1, "prefill_attention: seq_starts: ", seqs + 1, " entries expected");
  const int64_t* starts = seq_starts.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[seqs] == slots.numel(), "prefill_attention: seq_starts from 0 to the ",
              slots.numel(), " slots expected");
  int64_t rows = 0;
  for (int64_t i = 0; i < seqs; ++i) {
    TORCH_CHECK(ql[i] >= 1 && ql[i] <= starts[i + 1] - starts[i], "prefill_attention: sequence ", i, " has ", ql[i],
                " queries for ", starts[i + 1] - starts[i], " keys");
    rows += ql[i];
  }
  TORCH_CHECK(rows == T, "prefill_attention: q_lens add up to ", rows, ", q has ", T, " rows");
  for (int64_t l = 0; l < slots.numel(); ++l)
    TORCH_CHECK(0 <= sl[l] && sl[l] < S, "prefill_attention: slot ", sl[l], " outside the pool of ", S);
  auto out = at::empty({T, num_q, D}, q.options());
  const bf16* qp = q.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  for (int64_t i = 0, row = 0; i < seqs; row += ql[i], ++i) {
    const int64_t L = starts[i + 1] - starts[i];
    if (D == 64)
      prefill_sequence<4>(qp + row * q.stride(0), q.stride(0), num_q, k_cache.data_ptr<bf16>(),
                          v_cache.data_ptr<bf16>(), k_cache.stride(0), v_cache.stride(0), sl + starts[i], L, ql[i],
                          num_kv, float(scale), op + row * num_q * D);
    else
      prefill_sequence<8>(qp + row * q.stride(0), q.stride(0), num_q, k_cache.data_ptr<bf16>(),
                          v_cache.data_ptr<bf16>(), k_cache.stride(0), v_cache.stride(0), sl + starts[i], L, ql[i],
                          num_kv, float(scale), op + row * num_q * D);
  }
  return out;
}


// One Llama layer for B decode rows (B streams, one new token each), in place, all of it bf16 or all fp32:
//   residual <- x (first layer) or x + residual;  h = RMSNorm(residual) -> qkv -> rotary on q and k heads;
//   k, v stored at out_slots[b]; attention of row b's q over the keys at slots[slot_starts[b] : slot_starts[b+1]]
//   (its stream's context, the new token last); residual <- o_proj(attention) + residual;
//   x <- down(SiLU(gate) * up) of RMSNorm(residual).
// x, residual (B, H); cos, signed_sin (B, D): each token's rotary factors (signed_sin = -sin | sin, the factors of
// the half-swapped head); k_cache, v_cache (S, Hkv, D): the layer's pool rows. Each row's values are the same
// whatever B is and whichever rows share the call.
// A dense weight (N, K) of the activations' type, as a Mat
Mat dense_mat(const at::Tensor& w, at::ScalarType dtype, int64_t K, const char* what) {
  check_matrix(w, dtype, K, what);
  Mat m;
  m.dense = w.data_ptr();
  m.N = w.size(0);
  m.K = K;
  return m;
}

// A Q4_1 weight given as [codes (N, K / 2) uint8, d (N, K / 32) fp32, c (N, K / 32) fp32], as a Mat
Mat q4_mat(at::TensorList parts, int64_t K, const char* what) {
  TORCH_CHECK(parts.size() == 3, what, ": a Q4_1 weight is [codes, d, c], got ", parts.size(), " tensors");
  const at::Tensor &codes = parts[0], &d = parts[1], &c = parts[2];
  TORCH_CHECK(K % kGroup == 0, what, ": Q4_1 needs K a multiple of ", kGroup, ", got ", K);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) == K / 2,
              what, ": contiguous uint8 codes (N, ", K / 2, ") expected, got ", codes.scalar_type(), " ",
              codes.sizes());
  for (const at::Tensor* t : {&d, &c})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous() &&
                    t->size(0) == codes.size(0) && t->size(1) == K / kGroup,
                what, ": contiguous fp32 scales (", codes.size(0), ", ", K / kGroup, ") expected, got ",
                t->scalar_type(), " ", t->sizes());
  Mat m;
  m.codes = codes.data_ptr<uint8_t>();
  m.d = d.data_ptr<float>();
  m.c = c.data_ptr<float>();
  m.N = codes.size(0);
  m.K = K;
  return m;
}

// An int8 weight given as [q (N, K) int8, scale (N,) fp32], as a Mat
Mat int8_mat(at::TensorList parts, int64_t K, const char* what) {
  TORCH_CHECK(parts.size() == 2, what, ": an int8 weight is [q, scale], got ", parts.size(), " tensors");
  check_matrix(parts[0], at::kChar, K, what);
  check_vector(parts[1], at::kFloat, parts[0].size(0), what);
  Mat m;
  m.q8 = parts[0].data_ptr<int8_t>();
  m.d = parts[1].data_ptr<float>();
  m.N = parts[0].size(0);
  m.K = K;
  return m;
}

// x (K,) or (M, K) bf16 or fp32, and an int8 weight [q, scale] -> (N,) or (M, N) fp32; bf16_out: rounded to bf16
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, bool bf16_out) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && is_16_or_32(dtype), "deepinfer_cpu::int8_gemv: bf16 or fp32 CPU values expected");
  TORCH_CHECK(!bf16_out || dtype == at::kBFloat16, "deepinfer_cpu::int8_gemv: bf16_out takes bf16 inputs");
  TORCH_CHECK((x.dim() == 1 || x.dim() == 2) && x.is_contiguous(),
              "deepinfer_cpu::int8_gemv x: a contiguous (K,) or (M, K) input expected, got ", x.sizes());
  const int64_t K = x.size(-1), M = x.dim() == 2 ? x.size(0) : 1;
  const Mat w = int8_mat({q, scale}, K, "deepinfer_cpu::int8_gemv w");
  auto out = at::empty(x.dim() == 2 ? std::vector<int64_t>{M, w.N} : std::vector<int64_t>{w.N},
                       x.options().dtype(at::kFloat));
  if (M > 0 && dtype == at::kBFloat16)
    int8_into(x.data_ptr<bf16>(), w, out.data_ptr<float>(), M);
  else if (M > 0)
    int8_into(x.data_ptr<float>(), w, out.data_ptr<float>(), M);
  return bf16_out ? out.to(at::kBFloat16) : out;
}

// x (K,) or (M, K) bf16 or fp32, and a Q4_1 weight -> (N,) or (M, N) fp32 sums; bf16_out: rounded to bf16
at::Tensor q4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& c,
                   bool bf16_out) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && is_16_or_32(dtype), "deepinfer_cpu::q4_gemv: bf16 or fp32 CPU values expected");
  TORCH_CHECK(!bf16_out || dtype == at::kBFloat16, "deepinfer_cpu::q4_gemv: bf16_out takes bf16 inputs");
  TORCH_CHECK((x.dim() == 1 || x.dim() == 2) && x.is_contiguous(),
              "deepinfer_cpu::q4_gemv x: a contiguous (K,) or (M, K) input expected, got ", x.sizes());
  const int64_t K = x.size(-1), M = x.dim() == 2 ? x.size(0) : 1;
  const Mat w = q4_mat({codes, d, c}, K, "deepinfer_cpu::q4_gemv w");
  auto out = at::empty(x.dim() == 2 ? std::vector<int64_t>{M, w.N} : std::vector<int64_t>{w.N},
                       x.options().dtype(at::kFloat));
  if (M > 0 && dtype == at::kBFloat16)
    q4_into(x.data_ptr<bf16>(), w, out.data_ptr<float>(), M);
  else if (M > 0)
    q4_into(x.data_ptr<float>(), w, out.data_ptr<float>(), M);
  return bf16_out ? out.to(at::kBFloat16) : out;
}

// The checks and the call shared by both forms of decode_layer; weights already checked into Mats.
void decode_layer_mats(at::Tensor& x, at::Tensor& residual, bool first, const at::Tensor& in_norm,
                       const at::Tensor& post_norm, const Mat& qkv_w, const Mat& o_w, const Mat& gate_up_w,
                       const Mat& down_w, const at::Tensor& cos, const at::Tensor& signed_sin, at::Tensor& k_cache,
                       at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& slot_starts,
                       const at::Tensor& out_slots, int64_t num_q, int64_t num_kv, double eps, double scale) {
  const auto dtype = x.scalar_type();
  const int64_t B = x.size(0), H = x.size(1), D = cos.size(1), heads = num_q + 2 * num_kv;
  const int64_t inter = down_w.K;
  check_rows(residual, dtype, B, H, "residual");
  check_vector(in_norm, dtype, H, "input norm");
  check_vector(post_norm, dtype, H, "post-attention norm");
  check_rows(cos, dtype, B, D, "cos");
  check_rows(signed_sin, dtype, B, D, "signed sin");
  TORCH_CHECK(qkv_w.N == heads * D, "qkv: ", heads * D, " rows expected, got ", qkv_w.N);
  TORCH_CHECK(o_w.N == H, "o_proj: ", H, " rows expected");
  TORCH_CHECK(gate_up_w.N == 2 * inter, "gate_up: ", 2 * inter, " rows expected");
  TORCH_CHECK(down_w.N == H, "down: ", H, " rows expected");
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->scalar_type() == dtype && c->dim() == 3 && c->size(1) == num_kv && c->size(2) == D &&
                    c->stride(2) == 1 && c->stride(1) == D,
                "kv cache: ", dtype, " (S, ", num_kv, ", ", D, ") rows expected, got ", c->scalar_type(), " ",
                c->sizes());
  for (const at::Tensor* t : {&slots, &slot_starts, &out_slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "slots, slot_starts, out_slots: contiguous int64 vectors expected");
  TORCH_CHECK(slot_starts.numel() == B + 1 && out_slots.numel() == B, "slot_starts: B + 1 = ", B + 1,
              " entries and out_slots: B = ", B, " expected");
  TORCH_CHECK(num_kv > 0 && num_q % num_kv == 0 && D % 2 == 0, "heads: num_q a multiple of num_kv, even head_dim");
  const int64_t S = k_cache.size(0), total = slots.numel();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* start = slot_starts.data_ptr<int64_t>();
  const int64_t* out_slot = out_slots.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[B] == total, "slot_starts: from 0 to the ", total, " slots expected");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(start[b + 1] > start[b], "slot_starts: row ", b, " has no keys");
    TORCH_CHECK(0 <= out_slot[b] && out_slot[b] < S, "out_slot ", out_slot[b], " outside the pool of ", S);
  }
  for (int64_t l = 0; l < total; ++l) TORCH_CHECK(0 <= slot[l] && slot[l] < S, "slot ", slot[l], " outside the pool");
  if (dtype == at::kBFloat16)
    layer<bf16>(x, residual, first, in_norm, post_norm, qkv_w, o_w, gate_up_w, down_w, cos, signed_sin, k_cache,
                v_cache, slot, start, out_slot, B, num_q, num_kv, float(eps), float(scale));
  else
    layer<float>(x, residual, first, in_norm, post_norm, qkv_w, o_w, gate_up_w, down_w, cos, signed_sin, k_cache,
                 v_cache, slot, start, out_slot, B, num_q, num_kv, float(eps), float(scale));
}

void check_qkv(const Mat& qkv, int64_t num_q, int64_t num_kv, int64_t D) {
  TORCH_CHECK(qkv.N == (num_q + 2 * num_kv) * D, "qkv: ", (num_q + 2 * num_kv) * D, " rows expected, got ", qkv.N);
}

void check_layer_input(const at::Tensor& x, const at::Tensor& cos) {
  TORCH_CHECK(is_16_or_32(x.scalar_type()), "x: bf16 or fp32 values expected, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && cos.dim() == 2, "x (B, H) and cos (B, D) expected, got ", x.sizes(), " ", cos.sizes());
  check_rows(x, x.scalar_type(), x.size(0), x.size(1), "x");
}

// One Llama layer for B decode rows (B streams, one new token each), in place, all of it bf16 or all fp32:
//   residual <- x (first layer) or x + residual;  h = RMSNorm(residual) -> qkv -> rotary on q and k heads;
//   k, v stored at out_slots[b]; attention of row b's q over the keys at slots[slot_starts[b] : slot_starts[b+1]]
//   (its stream's context, the new token last); residual <- o_proj(attention) + residual;
//   x <- down(SiLU(gate) * up) of RMSNorm(residual).
// x, residual (B, H); cos, signed_sin (B, D): each token's rotary factors (signed_sin = -sin | sin, the factors of
// the half-swapped head); k_cache, v_cache (S, Hkv, D): the layer's pool rows. Each row's values are the same
// whatever B is and whichever rows share the call.
void decode_layer(at::Tensor& x, at::Tensor& residual, bool first, const at::Tensor& in_norm,
                  const at::Tensor& post_norm, const at::Tensor& qkv_w, const at::Tensor& o_w,
                  const at::Tensor& gate_up_w, const at::Tensor& down_w, const at::Tensor& cos,
                  const at::Tensor& signed_sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                  const at::Tensor& slot_starts, const at::Tensor& out_slots, int64_t num_q, int64_t num_kv,
                  double eps, double scale) {
  check_layer_input(x, cos);
  const auto dtype = x.scalar_type();
  const int64_t H = x.size(1), D = cos.size(1);
  const int64_t inter = down_w.dim() == 2 ? down_w.size(1) : 0;
  const Mat qkv = dense_mat(qkv_w, dtype, H, "qkv");  // made in order: a call's first fault is the one reported
  check_qkv(qkv, num_q, num_kv, D);
  const Mat o = dense_mat(o_w, dtype, num_q * D, "o_proj"), gate_up = dense_mat(gate_up_w, dtype, H, "gate_up");
  const Mat down = dense_mat(down_w, dtype, inter, "down");
  decode_layer_mats(x, residual, first, in_norm, post_norm, qkv, o, gate_up, down, cos, signed_sin, k_cache, v_cache,
                    slots, slot_starts, out_slots, num_q, num_kv, eps, scale);
}

// The same layer with quantized weights: each [codes, d, c] (Q4_1, q4_mat) or [q, scale] (int8 rows, int8_mat);
// activations bf16 or fp32.
Mat quantized_mat(at::TensorList parts, int64_t K, const char* what) {
  return parts.size() == 2 ? int8_mat(parts, K, what) : q4_mat(parts, K, what);
}

void decode_layer_q(at::Tensor& x, at::Tensor& residual, bool first, const at::Tensor& in_norm,
                    const at::Tensor& post_norm, at::TensorList qkv_w, at::TensorList o_w, at::TensorList gate_up_w,
                    at::TensorList down_w, const at::Tensor& cos, const at::Tensor& signed_sin, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& slot_starts,
                    const at::Tensor& out_slots, int64_t num_q, int64_t num_kv, double eps, double scale) {
  check_layer_input(x, cos);
  const int64_t H = x.size(1), D = cos.size(1);
  TORCH_CHECK((down_w.size() == 3 || down_w.size() == 2) && down_w[0].dim() == 2,
              "down: a quantized weight is [codes, d, c] (Q4_1) or [q, scale] (int8)");
  const int64_t inter = down_w.size() == 3 ? down_w[0].size(1) * 2 : down_w[0].size(1);
  const Mat qkv = quantized_mat(qkv_w, H, "qkv");
  check_qkv(qkv, num_q, num_kv, D);
  const Mat o = quantized_mat(o_w, num_q * D, "o_proj"), gate_up = quantized_mat(gate_up_w, H, "gate_up");
  const Mat down = quantized_mat(down_w, inter, "down");
  decode_layer_mats(x, residual, first, in_norm, post_norm, qkv, o, gate_up, down, cos, signed_sin, k_cache, v_cache,
                    slots, slot_starts, out_slots, num_q, num_kv, eps, scale);
}

}  // namespace

TORCH_LIBRARY(deepinfer_cpu, m) {
  m.def("gemv(Tensor x, Tensor w, bool bf16_out) -> Tensor");
  m.def("set_native_bf16(bool enabled) -> bool");
  m.def("q4_gemv(Tensor x, Tensor codes, Tensor d, Tensor c, bool bf16_out) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor q, Tensor scale, bool bf16_out) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor seq_starts, "
        "Tensor q_lens, float scale) -> Tensor");
  m.def(
      "decode_layer(Tensor(a!) x, Tensor(b!) residual, bool first, Tensor in_norm, Tensor post_norm, "
      "Tensor qkv_w, Tensor o_w, Tensor gate_up_w, Tensor down_w, Tensor cos, Tensor signed_sin, "
      "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slots, Tensor slot_starts, Tensor out_slots, int num_q, "
      "int num_kv, float eps, float scale) -> ()");
  m.def(
      "decode_layer_q(Tensor(a!) x, Tensor(b!) residual, bool first, Tensor in_norm, Tensor post_norm, "
      "Tensor[] qkv_w, Tensor[] o_w, Tensor[] gate_up_w, Tensor[] down_w, Tensor cos, Tensor signed_sin, "
      "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slots, Tensor slot_starts, Tensor out_slots, int num_q, "
      "int num_kv, float eps, float scale) -> ()");
}

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) { m.impl("set_native_bf16", &set_native_bf16); }

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layer_q", &decode_layer_q);
  m.impl("q4_gemv", &q4_gemv);
  m.impl("int8_gemv", &int8_gemv);
  m.impl("prefill_attention", &prefill_attention);
}
