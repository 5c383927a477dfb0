// The paged decode attention kernels of decode_kernels.cu under emu.h (run.sh) against an f64
// reference, on the shapes of crates/model/tests/paged_kv.rs. Arguments: case indices to run
// (default all), or --quick for the cases marked quick.
#include "emu.h"
#include "driver.h"
#include "decode_kernels_emu.cu"
#include <cstdio>
#include <cstring>
#include <random>
#include <cstdlib>

// misalign: the pools start one element past a 16-byte boundary (the kernels' element-wise
// copy paths instead of 16-byte loads and cp.async).
struct Case { int hq, hkv, d, bs; std::vector<int> lens; bool misalign = false; };

// As decode_plan in paged_attention.rs (`groups` = rows × KV heads): the vectorised passes'
// reduction region where some chunk fits with it, else the scalar passes'.
bool plan(int groups, int n_rep, int d, int longest, int& chunk, int& splits, size_t& bytes) {
  if (d <= 0 || d > 256) return false;
  const int thread_groups = 256 / d;
  const size_t scalar_red = (size_t)8 * d * (thread_groups - 1);
  const size_t vec_red = std::max(scalar_red, (size_t)7 * d * (d <= 128 ? 2 : 1));
  for (size_t reduction : {vec_red, scalar_red}) {
    auto need = [&](int c) { return 4 * ((size_t)n_rep * d + (size_t)n_rep * c + 2 * n_rep + reduction + c); };
    int pick = 0, smallest = 0;
    for (int c : {256, 128, 64, 32}) {
      if (need(c) > 48 * 1024) continue;
      smallest = c;
      if (!pick && (size_t)groups * ((longest + c - 1) / c) >= 256) pick = c;
    }
    if (!pick) pick = smallest;
    if (!pick) continue;
    chunk = pick; splits = std::max(1, (longest + pick - 1) / pick); bytes = need(pick);
    return splits <= 65535;
  }
  return false;
}


// The tensor-core kernel's dynamic shared memory (decode_cuda.rs's tc_shared_bytes): a round's
// key and value rows padded to d + 8 bf16, then its slots.
size_t tc_bytes(int d) {
  const int round = DT_WARPS * DT_BK(d);
  return (size_t)2 * round * (d + 8) * 2 + 4 * round;
}

// tc: launch paged_decode_tc_d{64,128}_bf16 (T = bf16) instead of paged_decode.
template <typename T>
double run(const Case& c, unsigned seed, bool& served, bool tc = false) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  const int rows = c.lens.size(), hq = c.hq, hkv = c.hkv, d = c.d, bs = c.bs, n_rep = hq / hkv;
  int num_blocks = 4;
  for (int l : c.lens) num_blocks += (l + bs - 1) / bs;
  std::vector<uint32_t> perm(num_blocks);
  for (int i = 0; i < num_blocks; i++) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<uint32_t>> tables;
  int at = 0, width = 1, longest = 0;
  for (int b = 0; b < rows; b++) {
    int n = (c.lens[b] + bs - 1) / bs + (b == 0);
    tables.emplace_back(perm.begin() + at, perm.begin() + at + n);
    at += n; width = std::max(width, n); longest = std::max(longest, c.lens[b]);
  }
  const size_t slots = (size_t)num_blocks * bs;
  std::vector<T> q(rows * hq * d), k_buf(slots * hkv * d + 8), v_buf(slots * hkv * d + 8);
  // 16-byte aligned starts (vector storage is), or one element past them.
  const size_t off = c.misalign ? 1 : 0;
  T* kp = k_buf.data() + off;
  T* vp = v_buf.data() + off;
  std::vector<T> k(slots * hkv * d), v(slots * hkv * d);
  for (auto& x : q) x = cvt<T>(U(rng));
  for (auto& x : k) x = cvt<T>(U(rng));
  for (auto& x : v) x = cvt<T>(U(rng));
  std::copy(k.begin(), k.end(), kp);
  std::copy(v.begin(), v.end(), vp);
  std::vector<uint32_t> flat(rows * width, 0), lens(rows);
  for (int b = 0; b < rows; b++) {
    std::copy(tables[b].begin(), tables[b].end(), flat.begin() + b * width);
    lens[b] = c.lens[b];
  }
  const float scale = 1.0f / std::sqrt((float)d);
  int chunk, splits; size_t bytes;
  served = plan(rows * hkv, n_rep, d, longest, chunk, splits, bytes);
  if (!served) return 0;
  std::vector<float> po, pm, pl;
  if (splits > 1) { po.resize((size_t)rows * hq * splits * d); pm.resize(rows * hq * splits); pl.resize(rows * hq * splits); }
  // The split counters: zero before each launch, and the kernel must leave them zero.
  std::vector<unsigned> counters(rows * hkv, 0);
  auto launch = [&](std::vector<T>& out) {
    float* po_ = splits > 1 ? po.data() : nullptr;
    float* pm_ = splits > 1 ? pm.data() : nullptr;
    float* pl_ = splits > 1 ? pl.data() : nullptr;
    if constexpr (sizeof(T) == 2) {
      if (tc) {
        emu_launch(Dim3{(unsigned)(rows * hkv), (unsigned)splits, 1}, Dim3{32 * DT_WARPS, 1, 1}, tc_bytes(d), [&] {
          if (d == 64)
            paged_decode_tc_d64_bf16(q.data(), kp, vp, flat.data(), lens.data(), out.data(), po_, pm_, pl_,
                                     counters.data(), hq, hkv, d, bs, width, chunk, splits, scale);
          else
            paged_decode_tc_d128_bf16(q.data(), kp, vp, flat.data(), lens.data(), out.data(), po_, pm_, pl_,
                                      counters.data(), hq, hkv, d, bs, width, chunk, splits, scale);
        });
      }
    }
    if (!tc) emu_launch(Dim3{(unsigned)(rows * hkv), (unsigned)splits, 1}, Dim3{256, 1, 1}, bytes, [&] {
      if constexpr (sizeof(T) == 4)
        paged_decode_f32(q.data(), kp, vp, flat.data(), lens.data(), out.data(), po_, pm_, pl_,
                         counters.data(), hq, hkv, d, bs, width, chunk, splits, scale);
      else
        paged_decode_bf16(q.data(), kp, vp, flat.data(), lens.data(), out.data(), po_, pm_, pl_,
                          counters.data(), hq, hkv, d, bs, width, chunk, splits, scale);
    });
  };
  // The blocks in launch order, then in reverse (another block of each row comes last and
  // merges): the same bits, and the counters back at zero after each launch.
  std::vector<T> out(rows * hq * d), again(rows * hq * d);
  launch(out);
  const bool zero_after = std::all_of(counters.begin(), counters.end(), [](unsigned x) { return x == 0; });
  emu_reverse_blocks = true;
  launch(again);
  emu_reverse_blocks = false;
  const bool zero_again = std::all_of(counters.begin(), counters.end(), [](unsigned x) { return x == 0; });
  if (!zero_after || !zero_again) {
    std::printf("  split counters not left at zero\n");
    return NAN;
  }
  if (std::memcmp(out.data(), again.data(), out.size() * sizeof(T)) != 0) {
    std::printf("  output bits depend on which block merges the chunks\n");
    return NAN;
  }
  // f64 reference on the same (rounded) inputs.
  double worst = 0;
  for (int b = 0; b < rows; b++)
    for (int h = 0; h < hq; h++) {
      const int g = h / n_rep, len = c.lens[b];
      std::vector<double> s(len);
      double m = -INFINITY;
      for (int j = 0; j < len; j++) {
        size_t slot = (size_t)tables[b][j / bs] * bs + j % bs;
        double acc = 0;
        for (int e = 0; e < d; e++) acc += back(q[(b * hq + h) * d + e]) * back(k[(slot * hkv + g) * d + e]);
        s[j] = acc * scale; m = std::max(m, s[j]);
      }
      double z = 0;
      for (auto& x : s) { x = std::exp(x - m); z += x; }
      for (int e = 0; e < d; e++) {
        double o = 0;
        for (int j = 0; j < len; j++) {
          size_t slot = (size_t)tables[b][j / bs] * bs + j % bs;
          o += s[j] / z * back(v[(slot * hkv + g) * d + e]);
        }
        // A NaN or infinite output fails the case (worst_of keeps a NaN).
        worst = worst_of(worst, std::abs(o - back(out[(b * hq + h) * d + e])));
      }
    }
  return worst;
}

int main(int argc, char** argv) {
  std::vector<Case> cases = {
      {6, 2, 16, 4, {1, 5, 8, 11, 13}},       {16, 4, 64, 16, {1700, 1, 1333, 1066}},
      {4, 4, 64, 1, {1, 7, 256, 300}},         {8, 4, 128, 16, {1, 16, 48, 513, 200}},
      {14, 2, 128, 5, {1, 10, 255, 257, 40}},  {7, 1, 64, 32, {64, 1, 31, 600}},
      {16, 1, 256, 16, {300, 3}},              {32, 1, 256, 8, {200, 1}},
      {4, 2, 80, 16, {33, 290}},               {2, 1, 320, 4, {5, 9}},
      // 40 query heads of dim 256: the vectorised passes' reduction does not fit beside them,
      // so bf16 takes the scalar passes too.
      {40, 1, 256, 16, {100, 3}},
      // 9–16 query heads a KV head: the tensor-core kernel's second 8 rows of each product.
      {16, 1, 64, 16, {1, 300}},               {12, 1, 128, 4, {33, 257}},
      // Pools one element past a 16-byte boundary: element-wise copies.
      {7, 1, 64, 16, {40, 129}, true},         {16, 2, 128, 8, {5, 70}, true},
  };
  {
    Case many{4, 2, 64, 16, {}};
    for (int i = 0; i < 128; i++) many.lens.push_back(1 + (i * 37) % 256);
    cases.push_back(many);
  }
  int bad = 0;
  if (argc > 1) {
    // Quick: one split (GQA 3, block size 4); keys split into chunks with block size 1, with
    // block size 5 and GQA 7, with head_dim 80; GQA 16 at head_dim 64; misaligned pools.
    const std::vector<size_t> quick = {0, 2, 4, 8, 11, 13};
    std::vector<Case> pick;
    for (int a = 1; a < argc; a++) {
      if (std::strcmp(argv[a], "--quick") == 0) {
        for (size_t i : quick) pick.push_back(cases[i]);
        continue;
      }
      const size_t i = std::strtoul(argv[a], nullptr, 10);
      if (i >= cases.size()) { std::fprintf(stderr, "no case %s (0..%zu)\n", argv[a], cases.size() - 1); return 2; }
      pick.push_back(cases[i]);
    }
    cases = pick;
  }
  for (auto& c : cases) {
    bool served;
    double e32 = run<float>(c, 7, served);
    double e16 = served ? run<bf16>(c, 8, served) : 0;
    // The tensor-core kernel where decode_cuda.rs launches it: head_dim 64 or 128, ≤ 16 query
    // heads a KV head.
    const bool tc = served && (c.d == 64 || c.d == 128) && c.hq / c.hkv <= 16;
    double etc = tc ? run<bf16>(c, 8, served, true) : 0;
    int chunk = 0, splits = 0; size_t bytes = 0; int longest = *std::max_element(c.lens.begin(), c.lens.end());
    plan((int)c.lens.size() * c.hkv, c.hq / c.hkv, c.d, longest, chunk, splits, bytes);
    std::printf("hq %2d hkv %d d %3d bs %2d: %s chunk %3d splits %d smem %6zu  f32 err %.2e  bf16 err %.2e",
                c.hq, c.hkv, c.d, c.bs, served ? "kernel" : "not served", chunk, splits, bytes, e32, e16);
    if (tc) std::printf("  tensor cores err %.2e", etc);
    std::printf("\n");
    // Written so that a NaN error (a NaN output, or a failed check above) fails the case.
    if (served && !(e32 <= 1e-5 && e16 <= 1e-2 && etc <= 1e-2)) bad++;
  }
  std::printf("%s\n", bad ? "FAIL" : "ALL OK");
  return bad != 0;
}
