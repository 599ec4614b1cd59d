// moe-bench-ann: recall@10 against queries/s in the manner of ann-benchmarks, for the index types
// ann-query builds (FAISS index_factory strings: Flat, HNSW32 at several ef, IVF-Flat and IVF-PQ at
// several nprobe), on synthetic clustered unit vectors, with each type's build time and size.
// Every setting is timed twice in alternation on the same index: through moe::AnnIndex (what
// ann-query calls) and through FAISS called directly on the index file AnnIndex wrote, at the same
// setting; the ratio is the wrapper's cost. Recall is against the exact top-k (the flat index).
#include <faiss/IVFlib.h>
#include <faiss/IndexHNSW.h>
#include <faiss/IndexIVF.h>
#include <faiss/index_io.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "bench_common.h"
#include "moe/ann_index.h"

namespace moe::bench {
namespace {

const char* kUsage =
    "usage: moe-bench-ann [options]\n"
    "  Recall@k vs queries/s of ann-query's index types, AnnIndex vs FAISS called directly.\n"
    "  --n N              catalog vectors (default 1000000; --quick: 20000)\n"
    "  --dim N            width (default 512)\n"
    "  --queries N        queries per search call, one call timed (default 200)\n"
    "  --k N              hits per query (default 10)\n"
    "  --types LIST       flat,hnsw,ivf-flat,ivf-pq (default all)\n"
    "  --nlist N          IVF lists (default: the power of two nearest 4 sqrt(n))\n"
    "  --pq N             IVF-PQ bytes per vector (default 64)\n"
    "  --ef LIST          HNSW32 efSearch values (default 16,32,64,128,256)\n"
    "  --nprobe LIST      IVF nprobe values (default 1,4,16,64)\n"
    "  --noise X          noise around each centre, relative to the centres' scale (default 2.5)\n"
    "  --reps N           timed samples, median reported (default 3)\n"
    "  --quick            20000 vectors\n"
    "  --json FILE        also write the results as JSON\n";

// n unit vectors around `centres` (c of them, dim wide): centre + uniform noise, normalised.
std::vector<float> clustered(int64_t n, int dim, const std::vector<float>& centres, float noise, uint64_t seed) {
  const int64_t c = static_cast<int64_t>(centres.size()) / dim;
  Rng rng(seed);
  std::vector<float> out(static_cast<size_t>(n * dim));
  for (int64_t i = 0; i < n; ++i) {
    const float* centre = centres.data() + static_cast<size_t>(static_cast<int64_t>(rng.next() % c) * dim);
    float* v = out.data() + static_cast<size_t>(i * dim);
    double norm = 0;
    for (int j = 0; j < dim; ++j) {
      v[j] = centre[j] + rng.symmetric(noise);
      norm += static_cast<double>(v[j]) * v[j];
    }
    const float inv = static_cast<float>(1.0 / std::sqrt(norm));
    for (int j = 0; j < dim; ++j) v[j] *= inv;
  }
  return out;
}

double recall(const std::vector<std::vector<AnnHit>>& got, const std::vector<std::vector<AnnHit>>& truth) {
  int64_t found = 0, total = 0;
  for (size_t q = 0; q < truth.size(); ++q) {
    std::set<int64_t> want;
    for (const AnnHit& h : truth[q]) want.insert(h.item);
    for (const AnnHit& h : got[q]) found += want.count(h.item);
    total += static_cast<int64_t>(want.size());
  }
  return total ? static_cast<double>(found) / static_cast<double>(total) : 0;
}

struct Setting {
  std::string label;  // "ef=64", "nprobe=16", "exact"
  AnnSearchOptions options;
};

struct Kind {
  std::string name;     // flat, hnsw, ivf-flat, ivf-pq
  std::string factory;  // FAISS's index_factory string
  std::vector<Setting> settings;
};

struct Row {
  std::string kind, factory, setting;
  double recall, build_s, bytes;
  PairedSample s;  // a: AnnIndex, b: FAISS directly
};

int run(int argc, char** argv) {
  Args args(argc, argv, kUsage);
  const bool quick = args.flag("quick");
  const int64_t n = args.integer("n", quick ? 20000 : 1000000);
  const int dim = static_cast<int>(args.integer("dim", 512));
  const int64_t nq = args.integer("queries", 200);
  const int k = static_cast<int>(args.integer("k", 10));
  const std::string type_list = args.str("types", "flat,hnsw,ivf-flat,ivf-pq");
  int64_t pow2 = 1;
  while (pow2 * 2 <= static_cast<int64_t>(4 * std::sqrt(static_cast<double>(n)) * 1.41)) pow2 *= 2;
  const int64_t nlist = args.integer("nlist", pow2);
  const int64_t pq = args.integer("pq", 64);
  const std::vector<int64_t> efs = args.int_list("ef", {16, 32, 64, 128, 256});
  const std::vector<int64_t> nprobes = args.int_list("nprobe", {1, 4, 16, 64});
  const double noise = args.number("noise", 2.5);
  TimingOptions t;
  t.reps = static_cast<int>(args.integer("reps", 3));
  t.warmup = 1;
  t.min_sample_s = 0.05;
  const std::string json_path = args.str("json", "");
  args.finish();
  if (n < 1 || dim < 1 || nq < 1 || k < 1 || nlist < 1 || pq < 1) args.fail("sizes must be >= 1");

  const char* threads = std::getenv("OMP_NUM_THREADS");
  const int64_t clusters = std::max<int64_t>(1, n / 100);
  std::printf(
      "# moe-bench-ann\n\n%lld vectors x %d (unit length, around %lld random centres, noise %.2g), %lld queries per "
      "call "
      "(from the same centres), k %d; OMP_NUM_THREADS=%s; %d samples per figure, alternated\n",
      static_cast<long long>(n), dim, static_cast<long long>(clusters), noise, static_cast<long long>(nq), k,
      threads ? threads : "(unset: FAISS's default)", t.reps);
  const std::vector<float> centres = random_floats(static_cast<size_t>(clusters * dim), 1.0f, 1);
  const std::vector<float> base = clustered(n, dim, centres, static_cast<float>(noise), 2);
  const std::vector<float> queries = clustered(nq, dim, centres, static_cast<float>(noise), 3);
  const std::vector<AnnItem> items(static_cast<size_t>(n));

  std::vector<Kind> kinds;
  const auto wanted = [&](const std::string& name) {
    return ("," + type_list + ",").find("," + name + ",") != std::string::npos;
  };
  if (wanted("flat")) kinds.push_back({"flat", "Flat", {{"exact", {}}}});
  if (wanted("hnsw")) {
    Kind hnsw{"hnsw", "HNSW32", {}};
    for (int64_t ef : efs) {
      AnnSearchOptions o;
      o.ef_search = static_cast<int>(ef);
      hnsw.settings.push_back({"ef=" + std::to_string(ef), o});
    }
    kinds.push_back(hnsw);
  }
  for (const std::string& ivf : {std::string("ivf-flat"), std::string("ivf-pq")}) {
    if (!wanted(ivf)) continue;
    Kind kind{ivf, "IVF" + std::to_string(nlist) + (ivf == "ivf-flat" ? ",Flat" : ",PQ" + std::to_string(pq)), {}};
    for (int64_t p : nprobes) {
      AnnSearchOptions o;
      o.nprobe = static_cast<int>(p);
      kind.settings.push_back({"nprobe=" + std::to_string(p), o});
    }
    kinds.push_back(kind);
  }

  char dir_template[] = "/tmp/moe-bench-ann-XXXXXX";
  if (!mkdtemp(dir_template)) args.fail("cannot create a temporary folder");
  const std::string dir = dir_template;

  // The exact top-k: the flat index's answer (FAISS IndexFlatIP, BLAS above 20 queries).
  std::vector<std::vector<AnnHit>> truth;
  {
    AnnIndex flat = AnnIndex::create(dim, {});
    flat.add(base.data(), n, items);
    truth = flat.search(queries.data(), nq, k);
  }

  std::vector<Row> rows;
  for (const Kind& kind : kinds) {
    std::fprintf(stderr, "[%s] building %s ...\n", kind.name.c_str(), kind.factory.c_str());
    const auto t0 = Clock::now();
    AnnBuildOptions build;
    build.index_type = kind.factory;
    AnnIndex index = AnnIndex::create(dim, build);
    index.add(base.data(), n, items);
    index.train();
    const double build_s = seconds_since(t0);
    const std::string path = dir + "/" + kind.name + ".faiss";
    index.save(path);
    struct stat st {};
    stat(path.c_str(), &st);
    std::unique_ptr<faiss::Index> direct(faiss::read_index(path.c_str()));
    std::fprintf(stderr, "[%s] built in %.1f s, %.1f MB\n", kind.name.c_str(), build_s, st.st_size / 1e6);

    for (const Setting& setting : kind.settings) {
      const double r = recall(index.search(queries.data(), nq, k, setting.options), truth);
      std::vector<float> scores(static_cast<size_t>(nq * k));
      std::vector<faiss::Index::idx_t> labels(static_cast<size_t>(nq * k));
      // FAISS at the same setting, as its documentation shows it: efSearch on the HNSW index,
      // SearchParametersIVF for IVF.
      std::function<void()> faiss_search;
      if (kind.name == "hnsw") {
        auto* hnsw = static_cast<faiss::IndexHNSW*>(direct.get());
        hnsw->hnsw.efSearch = std::max(setting.options.ef_search, k);
        faiss_search = [&, hnsw] { hnsw->search(nq, queries.data(), k, scores.data(), labels.data()); };
      } else if (kind.name == "flat") {
        faiss_search = [&] { direct->search(nq, queries.data(), k, scores.data(), labels.data()); };
      } else {
        faiss::IndexIVF* ivf = faiss::ivflib::extract_index_ivf(direct.get());
        faiss_search = [&, ivf] {
          faiss::SearchParametersIVF params;
          params.nprobe = static_cast<size_t>(setting.options.nprobe);
          ivf->search(nq, queries.data(), k, scores.data(), labels.data(), &params);
        };
      }
      const PairedSample s =
          time_paired([&] { index.search(queries.data(), nq, k, setting.options); }, faiss_search, nullptr, t);
      std::fprintf(stderr, "[%s] %s: recall %.3f, AnnIndex %.0f q/s, FAISS %.0f q/s\n", kind.name.c_str(),
                   setting.label.c_str(), r, nq / s.a.median, nq / s.b.median);
      rows.push_back({kind.name, kind.factory, setting.label, r, build_s, static_cast<double>(st.st_size), s});
    }
    unlink(path.c_str());
    unlink((path + ".items.jsonl").c_str());
  }
  rmdir(dir.c_str());

  Table table({"index", "factory", "setting", "recall@" + std::to_string(k), "queries/s", "FAISS direct queries/s",
               "AnnIndex vs FAISS", "build s", "index MB", "spread"});
  Json out = report_header("moe-bench-ann", quick);
  out.set("n", n);
  out.set("dim", dim);
  out.set("queries", nq);
  out.set("k", k);
  out.set("clusters", clusters);
  out.set("noise", noise);
  out.set("omp_num_threads", threads ? threads : "");
  Json& results = out.set("results", Json::array());
  for (const Row& r : rows) {
    const double qps = static_cast<double>(nq) / r.s.a.median;
    const double faiss_qps = static_cast<double>(nq) / r.s.b.median;
    table.add({r.kind, r.factory, r.setting, fmt(r.recall), fmt(qps), fmt(faiss_qps), fmt_ratio(1.0 / r.s.ratio),
               fmt(r.build_s), fmt(r.bytes / 1e6), fmt_pct(r.s.a.spread())});
    Json j = Json::object();
    j.set("index", r.kind);
    j.set("factory", r.factory);
    j.set("setting", r.setting);
    j.set("recall", r.recall);
    j.set("queries_per_s", qps);
    j.set("faiss_queries_per_s", faiss_qps);
    j.set("ratio_vs_faiss", 1.0 / r.s.ratio);
    j.set("build_s", r.build_s);
    j.set("index_bytes", r.bytes);
    j.set("timing", sample_json(r.s.a));
    j.set("faiss_timing", sample_json(r.s.b));
    results.push(j);
  }
  std::printf("\n");
  table.print();
  std::printf(
      "\nrecall@%d: share of the exact top-%d found. AnnIndex vs FAISS = median over alternated samples of "
      "time(FAISS) / time(AnnIndex) on the same index file at the same setting (1x: no overhead). build s: "
      "create + add + train (IVF trains on 64 vectors per list). index MB: the FAISS file's size.\n",
      k, k);
  write_json(json_path, out);
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  return moe::bench::guarded_main([&] { return moe::bench::run(argc, argv); });
}
