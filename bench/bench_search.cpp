// moe-bench-search: exact search of a flat index through a compute backend (AnnIndex::place_on:
// Backend::inner_product_topk, GPU-resident on CUDA) against the same index searched on the CPU
// as ann-query device=cpu does (FAISS's flat search; the engine's own CPU search below FAISS's
// BLAS threshold of 20 queries), timed in alternation in the same run (the ratio is the figure
// to read). Every run also checks that both give the same top-k.
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.h"
#include "moe/ann_index.h"

namespace moe::bench {
namespace {

const char* kUsage =
    "usage: moe-bench-search [options]\n"
    "  Flat-index search through a compute backend vs the CPU search (FAISS), same index and queries.\n"
    "  --quick            20000 items, batches 1,64 (default: 200000 items, batches 1,16,256)\n"
    "  --device LIST      auto (cpu, + cuda:0 when present) | cpu | cuda:N, comma-separated\n"
    "  --items N --dim N  index size and width (default dim 512)\n"
    "  --batches LIST     queries per search call\n"
    "  --k N              hits per query (default 10)\n"
    "  --reps N           timed samples, median reported (default 5)\n"
    "  --json FILE        also write the results as JSON\n";

struct Row {
  std::string device;
  int64_t batch;
  PairedSample s;  // a: the backend, b: the CPU search
  int64_t mismatches;
};

int run(int argc, char** argv) {
  Args args(argc, argv, kUsage);
  const bool quick = args.flag("quick");
  const std::vector<std::string> devices = resolve_devices(args.str("device", "auto"));
  const int64_t items = args.integer("items", quick ? 20000 : 200000);
  const int dim = static_cast<int>(args.integer("dim", 512));
  const std::vector<int64_t> batches =
      args.int_list("batches", quick ? std::vector<int64_t>{1, 64} : std::vector<int64_t>{1, 16, 256});
  const int k = static_cast<int>(args.integer("k", 10));
  TimingOptions t;
  t.reps = static_cast<int>(args.integer("reps", 5));
  t.min_sample_s = 0.05;
  const std::string json_path = args.str("json", "");
  args.finish();
  if (items < 1 || dim < 1 || k < 1 || k > 1024) args.fail("--items, --dim >= 1 and --k in 1..1024");

  std::printf("# moe-bench-search\n\nflat index: %lld items x %d, k %d; %d samples per figure, alternated\n",
              static_cast<long long>(items), dim, k, t.reps);
  const std::vector<float> base = random_floats(static_cast<size_t>(items * dim), 1.0f, 7);
  std::vector<AnnItem> labels(static_cast<size_t>(items));
  AnnIndex cpu_index = AnnIndex::create(dim, {});
  cpu_index.add(base.data(), items, labels);
  const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
  const std::vector<float> queries = random_floats(static_cast<size_t>(max_batch * dim), 1.0f, 8);

  std::vector<Row> rows;
  for (const std::string& device : devices) {
    AnnIndex placed = AnnIndex::create(dim, {});
    placed.add(base.data(), items, labels);
    if (device == "cpu")
      placed.place_on(make_backend("cpu", false), nullptr);  // the backend path, on the CPU
    else
      placed.place_on(device);
    for (int64_t B : batches) {
      const auto want = cpu_index.search(queries.data(), B, k);
      const auto got = placed.search(queries.data(), B, k);
      int64_t mismatches = 0;
      for (size_t q = 0; q < want.size(); ++q)
        for (size_t j = 0; j < want[q].size(); ++j) mismatches += got[q][j].item != want[q][j].item;
      const PairedSample s = time_paired([&] { placed.search(queries.data(), B, k); },
                                         [&] { cpu_index.search(queries.data(), B, k); }, nullptr, t);
      std::fprintf(stderr, "[%s] batch %lld: backend %.3f ms, CPU search %.3f ms\n", device.c_str(),
                   static_cast<long long>(B), s.a.median * 1e3, s.b.median * 1e3);
      rows.push_back({device, B, s, mismatches});
    }
  }

  Table table({"device", "batch", "queries/s", "CPU-search queries/s", "vs CPU search", "hits differing", "spread"});
  Json out = report_header("moe-bench-search", quick);
  out.set("items", items);
  out.set("dim", dim);
  out.set("k", k);
  out.set("baseline",
          "the same index searched as ann-query device=cpu does (FAISS IndexFlatIP; the engine's CPU "
          "search below 20 queries per call), alternated in the same run");
  Json& results = out.set("results", Json::array());
  for (const Row& r : rows) {
    const double qps = static_cast<double>(r.batch) / r.s.a.median;
    const double cpu_qps = static_cast<double>(r.batch) / r.s.b.median;
    table.add({r.device, std::to_string(r.batch), fmt(qps), fmt(cpu_qps), fmt_ratio(1.0 / r.s.ratio),
               std::to_string(r.mismatches), fmt_pct(r.s.a.spread())});
    Json j = Json::object();
    j.set("device", r.device);
    j.set("batch", r.batch);
    j.set("queries_per_s", qps);
    j.set("cpu_search_queries_per_s", cpu_qps);
    j.set("ratio_vs_cpu_search", 1.0 / r.s.ratio);
    j.set("hits_differing", r.mismatches);
    j.set("timing", sample_json(r.s.a));
    j.set("cpu_search_timing", sample_json(r.s.b));
    results.push(j);
  }
  std::printf("\n");
  table.print();
  std::printf(
      "\nvs CPU search = median over alternated samples of time(CPU search) / time(backend): above 1x the "
      "backend is faster. hits differing: top-k ids that differ (ties and float rounding only).\n");
  write_json(json_path, out);
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  return moe::bench::guarded_main([&] { return moe::bench::run(argc, argv); });
}
