// moe-bench-int4: the grouped SwiGLU experts with group-wise 4-bit weights (W4A16, CPU kernels of
// kernels/cpu/cpu_int4.h) against the CPU backend's grouped_swiglu with f32 and with f16 weights,
// on the same routed rows, in the same run; and the experts' bytes against f16.
//
// The layer is synthetic: random f32 experts (w1, w3 fan-in d; w2 fan-in I), a random f32 router
// whose top-k picks each row's experts (Mixtral routing); the 4-bit experts are those weights
// rounded to nearest per group (symmetric, f16 scales = max|w| / 7): bench data only, the
// format's own package makes the test fixtures. Both sides run on one thread (the CPU backend is
// opened with threads = 1): f32 and f16 experts through the backend's grouped_swiglu
// (cpu::grouped_swiglu: OpenBLAS), 4-bit ones through cpu_int4.h (beyond 12 rows per expert:
// dequantised blocks into the backend's oneDNN GEMM). So that the GEMM's share of that speed is
// visible, "f32 oneDNN" runs the same f32 experts as Backend::linear calls (the oneDNN GEMM on
// the weights as they are, the layout the 4-bit path's dequantised blocks have).
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.h"
#include "cpu_int4.h"

namespace moe::bench {
namespace {

const char* kUsage =
    "usage: moe-bench-int4 [options]\n"
    "  grouped SwiGLU experts: 4-bit weights (W4A16) vs f32 and f16 on the CPU, one thread each.\n"
    "  --hidden LIST       d values (default 512,1024)\n"
    "  --inter-factor N    intermediate size I = N × d (default 4, as moe-bench-layer)\n"
    "  --experts N         E (default 8)\n"
    "  --top-k N           k (default 2)\n"
    "  --group N           4-bit group size along the input (default 128)\n"
    "  --batches LIST      rows per forward (default 1,4,16,64,256)\n"
    "  --warmup N --reps N timing (default 2 and 7); median reported\n"
    "  --min-sample-ms X   group calls so that one timed sample lasts at least X ms (default 20)\n"
    "  --json FILE         also write the results as JSON\n";

// One expert matrix [n, k] rounded to 4 bits per group: symmetric, f16 scales.
struct Q4Matrix {
  std::vector<int32_t> packed;
  std::vector<uint16_t> scales;
  kernels::Q4Weight ref;
  Q4Matrix(const float* w, int64_t n, int64_t k, int group) {
    packed.assign(static_cast<size_t>(n * k / 8), 0);
    scales.resize(static_cast<size_t>(n * (k / group)));
    for (int64_t r = 0; r < n; ++r)
      for (int64_t g = 0; g < k / group; ++g) {
        float most = 0;
        for (int64_t c = g * group; c < (g + 1) * group; ++c) most = std::max(most, std::fabs(w[r * k + c]));
        const uint16_t s = float_to_half(std::max(most / 7.0f, 1e-7f));
        scales[static_cast<size_t>(r * (k / group) + g)] = s;
        const float scale = half_to_float(s);
        for (int64_t c = g * group; c < (g + 1) * group; ++c) {
          const long q = std::lround(std::min(7.0f, std::max(-8.0f, w[r * k + c] / scale)));
          packed[static_cast<size_t>((r * k + c) / 8)] |=
              static_cast<int32_t>(static_cast<uint32_t>(q + 8) << (4 * (c % 8)));
        }
      }
    ref.packed = packed.data();
    ref.scales = scales.data();
    ref.scale_type = kernels::WeightType::F16;
    ref.group_size = group;
  }
  size_t bytes() const { return packed.size() * sizeof(int32_t) + scales.size() * sizeof(uint16_t); }
};

// The grouped SwiGLU as Backend::linear calls per expert (the oneDNN GEMM on f32 weights).
void swiglu_by_linear(kernels::Backend& b, const float* xs, const std::vector<int64_t>& offsets,
                      const std::vector<kernels::ExpertWeights>& experts, int64_t d, int64_t I, float* gate, float* up,
                      float* out) {
  for (size_t e = 0; e < experts.size(); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;
    const float* x = xs + offsets[e] * d;
    b.linear(x, experts[e].w1, nullptr, gate, n, I, d);
    b.linear(x, experts[e].w3, nullptr, up, n, I, d);
    b.silu_mul(gate, up, gate, n * I);
    b.linear(gate, experts[e].w2, nullptr, out + offsets[e] * d, n, d, I);
  }
}

struct Row {
  int64_t d, batch;
  Sample f32, f16, q4, f32_onednn;
  // f32 (f16, f32 oneDNN) time / int4 time, medians of paired samples
  double speedup, speedup_f16, speedup_onednn;
  std::vector<int64_t> expert_rows;
};

int run(int argc, char** argv) {
  Args args(argc, argv, kUsage);
  const std::vector<int64_t> hiddens = args.int_list("hidden", {512, 1024});
  const int64_t factor = args.integer("inter-factor", 4);
  const int64_t E = args.integer("experts", 8), K = args.integer("top-k", 2);
  const int group = static_cast<int>(args.integer("group", 128));
  const std::vector<int64_t> batches = args.int_list("batches", {1, 4, 16, 64, 256});
  TimingOptions t;
  t.warmup = static_cast<int>(args.integer("warmup", 2));
  t.reps = static_cast<int>(args.integer("reps", 7));
  t.min_sample_s = args.number("min-sample-ms", 20) / 1000.0;
  const std::string json_path = args.str("json", "");
  args.finish();
  if (E <= 0 || K <= 0 || K > E || factor <= 0 || group <= 0 || group % 8 != 0)
    args.fail("need experts > 0, 0 < top-k <= experts, inter-factor > 0, group a positive multiple of 8");
  for (int64_t d : hiddens)
    if (d <= 0 || d % group != 0 || (factor * d) % group != 0)
      args.fail("every hidden size must be a multiple of group");

  kernels::CpuBackendOptions options;
  options.threads = 1;
  std::unique_ptr<kernels::Backend> b = kernels::make_cpu_backend(options);
  const kernels::cpu::Int4Isa isa = kernels::cpu::int4_best_isa();
  std::printf(
      "# moe-bench-int4\n\nexperts: %lld, top-%lld, intermediate %lld × hidden (SwiGLU); 4-bit: group %d, "
      "symmetric, f16 scales, %s kernels; baselines: the CPU backend's grouped_swiglu in f32 and f16, and f32 as "
      "Backend::linear calls (oneDNN); one thread each; %d warm-up + median of %d samples (≥ %.0f ms each)\n\n",
      static_cast<long long>(E), static_cast<long long>(K), static_cast<long long>(factor), group,
      kernels::cpu::int4_isa_name(isa), t.warmup, t.reps, t.min_sample_s * 1000);

  std::vector<Row> rows;
  Table memory({"hidden", "f32 bytes", "f16 bytes", "int4 bytes (+ scales)", "int4 / f16", "int4 / f32"});
  Json out = report_header("moe-bench-int4", false);
  Json& mem = out.set("memory", Json::array());
  for (int64_t d : hiddens) {
    const int64_t I = factor * d;
    const size_t mat = static_cast<size_t>(I * d);
    std::vector<std::vector<float>> dense(static_cast<size_t>(E));
    std::vector<Q4Matrix> q4;
    std::vector<std::vector<uint8_t>> half(static_cast<size_t>(E));
    std::vector<kernels::ExpertWeights> f32_refs, f16_refs, q4_refs;
    size_t q4_bytes = 0;
    for (int64_t e = 0; e < E; ++e) {
      std::vector<float>& w = dense[static_cast<size_t>(e)];
      w.resize(3 * mat);
      fill_uniform(w.data(), 2 * mat, 1.0f / std::sqrt(static_cast<float>(d)), 1000 + 3 * e);
      fill_uniform(w.data() + 2 * mat, mat, 1.0f / std::sqrt(static_cast<float>(I)), 1001 + 3 * e);
      q4.emplace_back(w.data(), I, d, group);
      q4.emplace_back(w.data() + mat, I, d, group);
      q4.emplace_back(w.data() + 2 * mat, d, I, group);
      f32_refs.push_back({{w.data(), kernels::WeightType::F32},
                          {w.data() + mat, kernels::WeightType::F32},
                          {w.data() + 2 * mat, kernels::WeightType::F32}});
      std::vector<uint8_t>& h = half[static_cast<size_t>(e)];
      h = to_weight_bytes(w, kernels::WeightType::F16);
      f16_refs.push_back({{h.data(), kernels::WeightType::F16},
                          {h.data() + 2 * mat, kernels::WeightType::F16},
                          {h.data() + 4 * mat, kernels::WeightType::F16}});
    }
    for (size_t e = 0; e < static_cast<size_t>(E); ++e) {
      q4_refs.push_back({{&q4[3 * e].ref, kernels::WeightType::Q4},
                         {&q4[3 * e + 1].ref, kernels::WeightType::Q4},
                         {&q4[3 * e + 2].ref, kernels::WeightType::Q4}});
      for (int j = 0; j < 3; ++j) q4_bytes += q4[3 * e + j].bytes();
    }
    const size_t f32_bytes = static_cast<size_t>(E) * 3 * mat * 4, f16_bytes = f32_bytes / 2;
    memory.add({std::to_string(d), std::to_string(f32_bytes), std::to_string(f16_bytes), std::to_string(q4_bytes),
                fmt(static_cast<double>(q4_bytes) / static_cast<double>(f16_bytes)),
                fmt(static_cast<double>(q4_bytes) / static_cast<double>(f32_bytes))});
    Json m = Json::object();
    m.set("hidden", d);
    m.set("intermediate", I);
    m.set("f32_bytes", static_cast<int64_t>(f32_bytes));
    m.set("f16_bytes", static_cast<int64_t>(f16_bytes));
    m.set("int4_bytes", static_cast<int64_t>(q4_bytes));
    m.set("int4_vs_f16", static_cast<double>(q4_bytes) / static_cast<double>(f16_bytes));
    mem.push(m);

    const std::vector<float> router = random_floats(static_cast<size_t>(E * d), 1.0f / std::sqrt(float(d)), 77);
    for (int64_t B : batches) {
      // Route once: the timed calls are the grouped experts alone, on the same rows.
      const std::vector<float> x = random_floats(static_cast<size_t>(B * d), 1.0f, 7 + B);
      std::vector<float> logits(static_cast<size_t>(B * E)), weights(static_cast<size_t>(B * K));
      std::vector<int32_t> ids(static_cast<size_t>(B * K)), slot_of(static_cast<size_t>(B * K));
      std::vector<float> xs(static_cast<size_t>(B * K * d)), outs(xs.size());
      b->linear(x.data(), {router.data(), kernels::WeightType::F32}, nullptr, logits.data(), B, E, d);
      b->topk_softmax(logits.data(), B, E, K, true, ids.data(), weights.data());
      const std::vector<int64_t> offsets = b->moe_permute(ids.data(), B, K, E, x.data(), d, xs.data(), slot_of.data());
      b->synchronize();
      auto f32 = [&] { b->grouped_swiglu(xs.data(), offsets, f32_refs, d, I, outs.data()); };
      auto f16 = [&] { b->grouped_swiglu(xs.data(), offsets, f16_refs, d, I, outs.data()); };
      auto int4 = [&] { b->grouped_swiglu(xs.data(), offsets, q4_refs, d, I, outs.data()); };
      std::vector<float> gate(static_cast<size_t>(B * K * I)), up(gate.size());
      auto f32_onednn = [&] {
        swiglu_by_linear(*b, xs.data(), offsets, f32_refs, d, I, gate.data(), up.data(), outs.data());
      };
      const PairedSample ps = time_paired(f32, int4, b.get(), t);
      const PairedSample ph = time_paired(f16, int4, b.get(), t);
      const PairedSample po = time_paired(f32_onednn, int4, b.get(), t);
      Row r{d, B, ps.a, ph.a, ps.b, po.a, ps.ratio, ph.ratio, po.ratio, {}};
      for (size_t e = 0; e + 1 < offsets.size(); ++e) r.expert_rows.push_back(offsets[e + 1] - offsets[e]);
      std::fprintf(stderr, "[hidden %lld] batch %lld: f32 %.3f ms, f16 %.3f ms, f32 oneDNN %.3f ms, int4 %.3f ms\n",
                   static_cast<long long>(d), static_cast<long long>(B), r.f32.median * 1e3, r.f16.median * 1e3,
                   r.f32_onednn.median * 1e3, r.q4.median * 1e3);
      rows.push_back(r);
    }
  }

  Table table({"hidden", "batch", "active experts", "f32 ms", "f16 ms", "f32 oneDNN ms", "int4 ms", "int4 vs f32",
               "int4 vs f16", "int4 vs f32 oneDNN", "spread"});
  Json& results = out.set("results", Json::array());
  for (const Row& r : rows) {
    int64_t active = 0;
    for (int64_t n : r.expert_rows) active += n > 0;
    table.add({std::to_string(r.d), std::to_string(r.batch), std::to_string(active), fmt(r.f32.median * 1e3),
               fmt(r.f16.median * 1e3), fmt(r.f32_onednn.median * 1e3), fmt(r.q4.median * 1e3), fmt_ratio(r.speedup),
               fmt_ratio(r.speedup_f16), fmt_ratio(r.speedup_onednn),
               fmt_pct(std::max({r.f32.spread(), r.f16.spread(), r.f32_onednn.spread(), r.q4.spread()}))});
    Json j = Json::object();
    j.set("hidden", r.d);
    j.set("batch", r.batch);
    j.set("active_experts", active);
    j.set("speedup_int4_vs_f32", r.speedup);
    j.set("speedup_int4_vs_f16", r.speedup_f16);
    j.set("speedup_int4_vs_f32_onednn", r.speedup_onednn);
    j.set("f32", sample_json(r.f32));
    j.set("f16", sample_json(r.f16));
    j.set("int4", sample_json(r.q4));
    j.set("f32_onednn", sample_json(r.f32_onednn));
    results.push(j);
  }
  Json& cfg = out.set("layer", Json::object());
  cfg.set("experts", E);
  cfg.set("top_k", K);
  cfg.set("inter_factor", factor);
  cfg.set("group_size", static_cast<int64_t>(group));
  cfg.set("isa", std::string(kernels::cpu::int4_isa_name(isa)));
  std::printf("## expert bytes\n\n");
  memory.print();
  std::printf("\n## grouped SwiGLU time (the experts of one forward)\n\n");
  table.print();
  write_json(json_path, out);
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  return moe::bench::guarded_main([&] { return moe::bench::run(argc, argv); });
}
