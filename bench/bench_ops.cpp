// moe-bench-ops: the CPU backend's element-wise, normalisation and attention operations at CLIP
// ViT-B/32 shapes, against the GEMMs of one vision layer at the same batch measured in the same
// run (the share those operations add to a layer).
//
// One vision layer at batch B has M = B·50 token rows, hidden 768, 12 heads × 64, MLP 3072; its
// GEMMs are the packed q/k/v projection (768 → 2304), the output projection (768 → 768) and the
// MLP (768 → 3072 → 768). The text tower's attention is timed at its longest prompt: B
// sequences of 77 tokens, 8 heads × 64, causal. gelu and quick_gelu work in place, so each of
// their calls first restores the input; the restore is timed in alternation with it and taken
// off.
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench_common.h"

namespace moe::bench {
namespace {

const char* kUsage =
    "usage: moe-bench-ops [options]\n"
    "  CPU element-wise, layer_norm and attention times at CLIP ViT-B/32 shapes; baseline = the\n"
    "  GEMMs of one vision layer at the same batch, in the same run.\n"
    "  --batch N          images (and texts) per batch (default 32)\n"
    "  --warmup N --reps N timing (default 2 and 7); median reported\n"
    "  --json FILE        also write the results as JSON\n";

constexpr int64_t kTokens = 50, kHidden = 768, kHeads = 12, kHeadDim = 64, kMlp = 3072;
constexpr int64_t kTextTokens = 77, kTextHeads = 8;

struct Row {
  std::string op, shape;
  int64_t per_layer;  // calls in one vision layer (0: not part of it)
  Sample s;
};

int run(int argc, char** argv) {
  Args args(argc, argv, kUsage);
  const int64_t batch = args.integer("batch", 32);
  TimingOptions t;
  t.warmup = static_cast<int>(args.integer("warmup", 2));
  t.reps = static_cast<int>(args.integer("reps", 7));
  t.min_sample_s = 0.02;
  const std::string json_path = args.str("json", "");
  args.finish();
  if (batch < 1) args.fail("--batch: at least 1");

  std::unique_ptr<kernels::Backend> cpu = make_backend("cpu", false);
  const int64_t rows = batch * kTokens;
  const auto buffer = [&](size_t n, float scale, uint64_t seed) {
    const std::vector<float> v = random_floats(n, scale, seed);
    return DeviceBuffer(*cpu, v.data(), n * sizeof(float));
  };
  const size_t mlp = static_cast<size_t>(rows * kMlp), hidden = static_cast<size_t>(rows * kHidden);

  // The layer's GEMMs (the baseline).
  const DeviceBuffer x = buffer(hidden, 1.0f, 1), h = buffer(mlp, 1.0f, 2);
  const DeviceBuffer w_qkv = buffer(3 * kHidden * kHidden, 0.05f, 3), w_out = buffer(kHidden * kHidden, 0.05f, 4);
  const DeviceBuffer w_fc1 = buffer(kMlp * kHidden, 0.05f, 5), w_fc2 = buffer(kHidden * kMlp, 0.05f, 6);
  const DeviceBuffer bias = buffer(kMlp, 0.05f, 7);
  DeviceBuffer y(*cpu, mlp * sizeof(float));
  const auto linear = [&](const DeviceBuffer& in, const DeviceBuffer& w, int64_t n, int64_t k) {
    cpu->linear(in.get<float>(), {w.get(), kernels::WeightType::F32}, bias.get<float>(), y.get<float>(), rows, n, k);
  };
  std::fprintf(stderr, "timing the layer's GEMMs (M = %lld)\n", static_cast<long long>(rows));
  const Sample gemm = time_calls(
      [&] {
        linear(x, w_qkv, 3 * kHidden, kHidden);
        linear(x, w_out, kHidden, kHidden);
        linear(x, w_fc1, kMlp, kHidden);
        linear(h, w_fc2, kHidden, kMlp);
      },
      cpu.get(), t);

  std::vector<Row> table_rows;
  const auto add = [&](std::string op, std::string shape, int64_t per_layer, Sample s) {
    std::fprintf(stderr, "%s %s: %.3f ms\n", op.c_str(), shape.c_str(), s.median * 1e3);
    table_rows.push_back({std::move(op), std::move(shape), per_layer, s});
  };
  const std::string mlp_shape = std::to_string(rows) + "×" + std::to_string(kMlp);

  // In place: restore the input, then the op; minus the restore alone, timed in alternation.
  const DeviceBuffer pristine = buffer(mlp, 3.0f, 8);
  DeviceBuffer act(*cpu, mlp * sizeof(float));
  const auto restore = [&] { std::memcpy(act.get(), pristine.get(), mlp * sizeof(float)); };
  const auto in_place = [&](const std::function<void(float*, int64_t)>& op) {
    const PairedSample p = time_paired(
        [&] {
          restore();
          op(act.get<float>(), static_cast<int64_t>(mlp));
        },
        restore, cpu.get(), t);
    Sample s = p.a;
    s.median = p.a.median - p.b.median;
    s.min = p.a.min - p.b.median;
    s.max = p.a.max - p.b.median;
    return s;
  };
  add("quick_gelu", mlp_shape, 1, in_place([&](float* v, int64_t n) { cpu->quick_gelu(v, n); }));
  add("gelu", mlp_shape, 0, in_place([&](float* v, int64_t n) { cpu->gelu(v, n); }));

  const DeviceBuffer up = buffer(mlp, 3.0f, 9);
  add("silu_mul", mlp_shape, 0,
      time_calls(
          [&] { cpu->silu_mul(pristine.get<float>(), up.get<float>(), y.get<float>(), static_cast<int64_t>(mlp)); },
          cpu.get(), t));

  // Residual-stream rows: a mean well away from 0, as between CLIP's layers.
  std::vector<float> ln_in = random_floats(hidden, 2.0f, 10);
  for (float& v : ln_in) v += 1.0f;
  const DeviceBuffer ln_x(*cpu, ln_in.data(), hidden * sizeof(float));
  const DeviceBuffer gamma = buffer(kHidden, 1.0f, 11), beta = buffer(kHidden, 1.0f, 12);
  add("layer_norm", std::to_string(rows) + "×" + std::to_string(kHidden), 2,
      time_calls(
          [&] {
            cpu->layer_norm(ln_x.get<float>(), gamma.get<float>(), beta.get<float>(), y.get<float>(), rows, kHidden,
                            1e-5f);
          },
          cpu.get(), t));
  add("add", std::to_string(rows) + "×" + std::to_string(kHidden), 2,
      time_calls([&] { cpu->add(y.get<float>(), x.get<float>(), static_cast<int64_t>(hidden)); }, cpu.get(), t));

  const auto attention = [&](int64_t seq, int64_t heads, bool causal, uint64_t seed) {
    const DeviceBuffer qkv = buffer(static_cast<size_t>(batch * seq * 3 * heads * kHeadDim), 1.0f, seed);
    const std::vector<int64_t> lens(static_cast<size_t>(batch), seq);
    return time_calls([&] { cpu->attention(qkv.get<float>(), y.get<float>(), lens, heads, kHeadDim, causal); },
                      cpu.get(), t);
  };
  const auto attention_shape = [&](int64_t seq, int64_t heads, const char* mask) {
    return std::to_string(batch) + "×" + std::to_string(seq) + ", " + std::to_string(heads) + "×" +
           std::to_string(kHeadDim) + ", " + mask;
  };
  add("attention (vision)", attention_shape(kTokens, kHeads, "full"), 1, attention(kTokens, kHeads, false, 13));
  add("attention (text)", attention_shape(kTextTokens, kTextHeads, "causal"), 0,
      attention(kTextTokens, kTextHeads, true, 14));

  std::printf(
      "# moe-bench-ops\n\nCPU backend, batch %lld (ViT-B/32: %lld tokens × %lld, MLP %lld); %d warm-up + median of "
      "%d\n\n",
      static_cast<long long>(batch), static_cast<long long>(kTokens), static_cast<long long>(kHidden),
      static_cast<long long>(kMlp), t.warmup, t.reps);
  Table table({"op", "shape", "ms/call", "calls/layer", "share of layer GEMMs", "spread"});
  Json out = report_header("moe-bench-ops", false);
  out.set("batch", batch);
  out.set("baseline", "the GEMMs of one ViT-B/32 vision layer at the same batch, in the same run");
  out.set("layer_gemms", sample_json(gemm));
  Json& results = out.set("results", Json::array());
  double layer_ops = 0;
  for (const Row& r : table_rows) {
    const double share = static_cast<double>(std::max<int64_t>(r.per_layer, 1)) * r.s.median / gemm.median;
    layer_ops += static_cast<double>(r.per_layer) * r.s.median;
    table.add({r.op, r.shape, fmt(r.s.median * 1e3), r.per_layer ? std::to_string(r.per_layer) : "-", fmt_pct(share),
               fmt_pct(r.s.spread())});
    Json j = Json::object();
    j.set("op", r.op);
    j.set("shape", r.shape);
    j.set("calls_per_layer", r.per_layer);
    j.set("share_of_layer_gemms", share);
    j.set("timing", sample_json(r.s));
    results.push(j);
  }
  table.add(
      {"layer GEMMs", std::to_string(rows) + " rows", fmt(gemm.median * 1e3), "1", "100%", fmt_pct(gemm.spread())});
  table.add(
      {"vision layer ops", "rows with calls/layer", fmt(layer_ops * 1e3), "", fmt_pct(layer_ops / gemm.median), ""});
  out.set("vision_layer_ops_share", layer_ops / gemm.median);
  table.print();
  std::printf(
      "\nshare = calls/layer × ms/call ÷ the layer's GEMM time (calls/layer \"-\": one call). gelu and quick_gelu:\n"
      "(restore + op) − restore, timed in alternation.\n");
  write_json(json_path, out);
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  return moe::bench::guarded_main([&] { return moe::bench::run(argc, argv); });
}
