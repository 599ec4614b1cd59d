// moe-bench-layer: throughput of one MoE layer through a Backend, against a dense GEMM of the
// same FLOPs through the same backend, measured in the same run.
//
// The layer is synthetic (random weights): router Linear(d→E) in f32, softmax top-k with
// renormalisation (Mixtral), SwiGLU experts w2(silu(w1 x) · w3 x) with weights in the chosen
// precision. One forward is the engine's MoE path on the backend:
//   linear (router) → topk_softmax → moe_permute → grouped_swiglu → moe_unpermute.
// The dense baseline is one linear y[B, 3·k·I] = x[B, d] · W[3·k·I, d]ᵀ in the same precision:
// exactly the expert FLOPs of the forward (2·B·k·3·d·I), and at batch 1 the same weight bytes
// (k experts' w1, w3, w2). The ratio MoE FLOP/s ÷ dense FLOP/s therefore says how much of the
// backend's GEMM rate the grouped MoE path keeps (router FLOPs, 2·B·d·E, are not counted).
// The experts' weights are not given to prepare_linear_weight. With --compare-prepared, a copy of
// the layer whose expert weights are (as MoeLayer prepares them at load) is timed against it,
// paired, on the same backend.
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "bench_common.h"

namespace moe::bench {
namespace {

const char* kUsage =
    "usage: moe-bench-layer [options]\n"
    "  MoE layer tokens/s through a Backend and its share of a dense GEMM of equal FLOPs.\n"
    "  --quick             small sizes for a smoke run (hidden 512, batches 1,4,16,64,256)\n"
    "  --device LIST       auto (cpu, + cuda:0 when present) | cpu | cuda:N, comma-separated\n"
    "  --precision LIST    weight types, from f32,f16,bf16 (default all three)\n"
    "  --batches LIST      tokens per forward (default 1,2,4,...,8192)\n"
    "  --hidden N          d (default 1024; --quick 512)\n"
    "  --experts N         E (default 8)\n"
    "  --top-k N           k (default 2)\n"
    "  --inter N           expert intermediate size I (default 4 × hidden)\n"
    "  --warmup N --reps N timing (default 2 and 7; --quick 1 and 5); median reported\n"
    "  --min-sample-ms X   group calls so that one timed sample lasts at least X ms (default 20)\n"
    "  --compare-prepared  also time the forward with the expert weights prepared\n"
    "                      (Backend::prepare_linear_weight, as MoeLayer does at load)\n"
    "                      against unprepared ones, paired\n"
    "  --json FILE         also write the results as JSON\n";

struct Config {
  int64_t d, E, k, I;
};

struct Layer {
  DeviceBuffer router;                // [E, d] f32
  std::vector<DeviceBuffer> experts;  // per expert: w1 | w3 | w2 in the weight type
  std::vector<kernels::ExpertWeights> refs;
  DeviceBuffer dense;  // [3·k·I, d]
};

// The expert weights of a Layer given to Backend::prepare_linear_weight, released with this.
class PreparedExperts {
 public:
  PreparedExperts(kernels::Backend& b, const Layer& L, const Config& c) : b_(&b), refs_(L.refs), c_(c) {
    for (const kernels::ExpertWeights& e : refs_) {
      b_->prepare_linear_weight(e.w1, c_.I, c_.d);
      b_->prepare_linear_weight(e.w3, c_.I, c_.d);
      b_->prepare_linear_weight(e.w2, c_.d, c_.I);
    }
  }
  ~PreparedExperts() {
    for (const kernels::ExpertWeights& e : refs_) {
      b_->release_linear_weight(e.w1, c_.I, c_.d);
      b_->release_linear_weight(e.w3, c_.I, c_.d);
      b_->release_linear_weight(e.w2, c_.d, c_.I);
    }
  }
  PreparedExperts(const PreparedExperts&) = delete;
  PreparedExperts& operator=(const PreparedExperts&) = delete;

 private:
  kernels::Backend* b_;
  std::vector<kernels::ExpertWeights> refs_;
  Config c_;
};

Layer make_layer(kernels::Backend& b, const Config& c, kernels::WeightType type, uint64_t seed) {
  const float sd = 1.0f / std::sqrt(static_cast<float>(c.d));
  const float si = 1.0f / std::sqrt(static_cast<float>(c.I));
  const std::vector<float> router = random_floats(static_cast<size_t>(c.E * c.d), sd, seed);
  const size_t mat = static_cast<size_t>(c.I * c.d);
  const size_t es = kernels::weight_type_size(type);
  const std::vector<float> dense = random_floats(3 * static_cast<size_t>(c.k) * mat, sd, seed + 99991);
  const std::vector<uint8_t> dbytes = to_weight_bytes(dense, type);
  Layer L{DeviceBuffer(b, router.data(), router.size() * sizeof(float)),
          {},
          {},
          DeviceBuffer(b, dbytes.data(), dbytes.size())};
  for (int64_t e = 0; e < c.E; ++e) {
    std::vector<float> w(3 * mat);
    fill_uniform(w.data(), 2 * mat, sd, seed + 1 + 3 * e);        // w1, w3: fan-in d
    fill_uniform(w.data() + 2 * mat, mat, si, seed + 2 + 3 * e);  // w2: fan-in I
    const std::vector<uint8_t> bytes = to_weight_bytes(w, type);
    L.experts.emplace_back(b, bytes.data(), bytes.size());
    const uint8_t* p = L.experts.back().get<uint8_t>();
    L.refs.push_back({{p, type}, {p + mat * es, type}, {p + 2 * mat * es, type}});
  }
  return L;
}

struct Row {
  std::string device, precision;
  int64_t batch;
  Sample moe, dense;
  double ratio;  // MoE FLOP/s ÷ dense FLOP/s, median of paired samples
  double flops;  // expert FLOPs of one forward (= the dense linear's)
  std::vector<int64_t> expert_rows;
  // --compare-prepared: the forward with prepared expert weights, and unprepared time ÷ its time
  // (median of paired samples).
  Sample prepared;
  double prepared_speedup = 0;
};

int run(int argc, char** argv) {
  Args args(argc, argv, kUsage);
  const bool quick = args.flag("quick");
  const std::string device_spec = args.str("device", "auto");
  const std::vector<std::string> precisions = args.str_list("precision", "f32,f16,bf16");
  std::vector<int64_t> default_batches;
  if (quick)
    default_batches = {1, 4, 16, 64, 256};
  else
    for (int64_t b = 1; b <= 8192; b *= 2) default_batches.push_back(b);
  const std::vector<int64_t> batches = args.int_list("batches", default_batches);
  Config c;
  c.d = args.integer("hidden", quick ? 512 : 1024);
  c.E = args.integer("experts", 8);
  c.k = args.integer("top-k", 2);
  c.I = args.integer("inter", 4 * c.d);
  TimingOptions t;
  t.warmup = static_cast<int>(args.integer("warmup", quick ? 1 : 2));
  t.reps = static_cast<int>(args.integer("reps", quick ? 5 : 7));
  t.min_sample_s = args.number("min-sample-ms", 20) / 1000.0;
  const std::string json_path = args.str("json", "");
  const bool compare_prepared = args.flag("compare-prepared");
  args.finish();
  const std::vector<std::string> devices = resolve_devices(device_spec);
  if (c.d <= 0 || c.E <= 0 || c.k <= 0 || c.k > c.E || c.I <= 0)
    args.fail("need hidden, inter, experts > 0 and 0 < top-k <= experts");
  for (const std::string& p : precisions) parse_precision(p);

  std::printf(
      "# moe-bench-layer\n\nlayer: hidden %lld, %lld experts, top-%lld, intermediate %lld (SwiGLU); "
      "router f32; %d warm-up + median of %d samples (≥ %.0f ms each)\n",
      static_cast<long long>(c.d), static_cast<long long>(c.E), static_cast<long long>(c.k),
      static_cast<long long>(c.I), t.warmup, t.reps, t.min_sample_s * 1000);
  std::printf("baseline: dense linear [B, %lld] x [%lld, %lld]^T of the same FLOPs, same backend and precision\n\n",
              static_cast<long long>(c.d), static_cast<long long>(3 * c.k * c.I), static_cast<long long>(c.d));

  std::vector<Row> rows;
  const int64_t bmax = *std::max_element(batches.begin(), batches.end());
  for (const std::string& device : devices) {
    std::unique_ptr<kernels::Backend> b = make_backend(device, false);
    // Activations and scratch for the largest batch, reused by every size.
    const std::vector<float> xh = random_floats(static_cast<size_t>(bmax * c.d), 1.0f, 7);
    DeviceBuffer x(*b, xh.data(), xh.size() * sizeof(float));
    DeviceBuffer logits(*b, static_cast<size_t>(bmax * c.E) * sizeof(float));
    DeviceBuffer ids(*b, static_cast<size_t>(bmax * c.k) * sizeof(int32_t));
    DeviceBuffer rw(*b, static_cast<size_t>(bmax * c.k) * sizeof(float));
    DeviceBuffer slot_of(*b, static_cast<size_t>(bmax * c.k) * sizeof(int32_t));
    DeviceBuffer xs(*b, static_cast<size_t>(bmax * c.k * c.d) * sizeof(float));
    DeviceBuffer outs(*b, static_cast<size_t>(bmax * c.k * c.d) * sizeof(float));
    DeviceBuffer y(*b, static_cast<size_t>(bmax * c.d) * sizeof(float));
    DeviceBuffer yd(*b, static_cast<size_t>(bmax * 3 * c.k * c.I) * sizeof(float));
    for (const std::string& prec : precisions) {
      const kernels::WeightType type = parse_precision(prec);
      std::fprintf(stderr, "[%s %s] preparing weights...\n", device.c_str(), prec.c_str());
      Layer L = make_layer(*b, c, type, 1000);
      // The same weights in other memory (prepared weights are found by their address), prepared.
      std::optional<Layer> LP;
      std::optional<PreparedExperts> prepared;
      if (compare_prepared) {
        LP.emplace(make_layer(*b, c, type, 1000));
        prepared.emplace(*b, *LP, c);
      }
      for (int64_t B : batches) {
        std::vector<int64_t> offsets;
        auto forward = [&](const Layer& layer) {
          b->linear(x.get<float>(), {layer.router.get(), kernels::WeightType::F32}, nullptr, logits.get<float>(), B,
                    c.E, c.d);
          b->topk_softmax(logits.get<float>(), B, c.E, c.k, true, ids.get<int32_t>(), rw.get<float>());
          offsets = b->moe_permute(ids.get<int32_t>(), B, c.k, c.E, x.get<float>(), c.d, xs.get<float>(),
                                   slot_of.get<int32_t>());
          b->grouped_swiglu(xs.get<float>(), offsets, layer.refs, c.d, c.I, outs.get<float>());
          b->moe_unpermute(outs.get<float>(), slot_of.get<int32_t>(), rw.get<float>(), B, c.k, c.d, y.get<float>());
        };
        auto moe = [&] { forward(L); };
        auto dense = [&] {
          b->linear(x.get<float>(), {L.dense.get(), type}, nullptr, yd.get<float>(), B, 3 * c.k * c.I, c.d);
        };
        Row r{device, prec, B, {}, {}, 0, 2.0 * static_cast<double>(B * c.k * 3 * c.d * c.I), {}, {}, 0};
        // Dense and MoE samples alternate; the ratio is the median of adjacent pairs' ratios.
        const PairedSample ps = time_paired(dense, moe, b.get(), t);
        r.dense = ps.a;
        r.moe = ps.b;
        r.ratio = ps.ratio;  // dense time / MoE time = MoE FLOP/s / dense FLOP/s
        if (LP) {
          const PairedSample pp = time_paired(
              moe, [&] { forward(*LP); }, b.get(), t);
          r.prepared = pp.b;
          r.prepared_speedup = pp.ratio;  // unprepared time / prepared time
          std::fprintf(stderr, "[%s %s] batch %lld: moe with prepared experts %.3f ms (%.3fx)\n", device.c_str(),
                       prec.c_str(), static_cast<long long>(B), r.prepared.median * 1e3, r.prepared_speedup);
        }
        for (size_t e = 0; e + 1 < offsets.size(); ++e) r.expert_rows.push_back(offsets[e + 1] - offsets[e]);
        std::fprintf(stderr, "[%s %s] batch %lld: moe %.3f ms, dense %.3f ms\n", device.c_str(), prec.c_str(),
                     static_cast<long long>(B), r.moe.median * 1e3, r.dense.median * 1e3);
        rows.push_back(r);
      }
    }
  }

  std::vector<std::string> header = {"device",      "weights",       "batch",     "tokens/s",   "ms/forward",
                                     "MoE GFLOP/s", "dense GFLOP/s", "MoE/dense", "vs batch 1", "spread"};
  if (compare_prepared) header.insert(header.end(), {"ms prepared", "prepared speed-up", "spread prepared"});
  Table table(header);
  Json out = report_header("moe-bench-layer", quick);
  Json& cfg = out.set("layer", Json::object());
  cfg.set("hidden", c.d);
  cfg.set("experts", c.E);
  cfg.set("top_k", c.k);
  cfg.set("intermediate", c.I);
  cfg.set("router", "f32, softmax top-k renormalised");
  out.set("baseline", "dense linear of the same FLOPs (x[B,d] * W[3*k*I,d]^T), same backend and precision");
  Json& results = out.set("results", Json::array());
  for (const Row& r : rows) {
    double base_tps = 0;
    for (const Row& q : rows)
      if (q.device == r.device && q.precision == r.precision && q.batch == batches.front())
        base_tps = static_cast<double>(q.batch) / q.moe.median;
    const double tps = static_cast<double>(r.batch) / r.moe.median;
    const double moe_rate = r.flops / r.moe.median, dense_rate = r.flops / r.dense.median;
    std::vector<std::string> cells = {r.device,
                                      r.precision,
                                      std::to_string(r.batch),
                                      fmt(tps),
                                      fmt(r.moe.median * 1e3),
                                      fmt(moe_rate / 1e9),
                                      fmt(dense_rate / 1e9),
                                      fmt_ratio(r.ratio),
                                      fmt_ratio(tps / base_tps),
                                      fmt_pct(std::max(r.moe.spread(), r.dense.spread()))};
    if (compare_prepared)
      cells.insert(cells.end(),
                   {fmt(r.prepared.median * 1e3), fmt_ratio(r.prepared_speedup), fmt_pct(r.prepared.spread())});
    table.add(cells);
    Json j = Json::object();
    j.set("device", r.device);
    j.set("precision", r.precision);
    j.set("batch", r.batch);
    j.set("tokens_per_s", tps);
    j.set("moe_flop_per_s", moe_rate);
    j.set("dense_flop_per_s", dense_rate);
    j.set("ratio_moe_vs_dense", r.ratio);
    j.set("ratio_tokens_per_s_vs_first_batch", tps / base_tps);
    j.set("flops_per_forward", r.flops);
    j.set("moe", sample_json(r.moe));
    j.set("dense", sample_json(r.dense));
    Json rowsj = Json::array();
    for (int64_t n : r.expert_rows) rowsj.push(n);
    j.set("rows_per_expert", rowsj);
    if (compare_prepared) {
      j.set("moe_prepared", sample_json(r.prepared));
      j.set("ratio_unprepared_vs_prepared_time", r.prepared_speedup);
    }
    results.push(j);
  }
  table.print();
  std::printf(
      "\nMoE/dense = MoE FLOP/s ÷ dense FLOP/s = dense time ÷ MoE time (equal FLOPs), median over "
      "alternating pairs of samples; "
      "vs batch 1 = tokens/s ÷ tokens/s at batch %lld; spread = (max-min)/median of the noisier timing.\n",
      static_cast<long long>(batches.front()));
  if (compare_prepared)
    std::printf(
        "prepared speed-up = time with unprepared expert weights ÷ time with prepared ones, median over alternating "
        "pairs of samples (a separate pairing from MoE/dense).\n");
  write_json(json_path, out);
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  return moe::bench::guarded_main([&] { return moe::bench::run(argc, argv); });
}
