// moe-bench-ann: recall@10 against queries/s in the manner of ann-benchmarks, for the index types
// ann-query builds (FAISS index_factory strings: Flat, HNSW at several ef, IVF-Flat and IVF-PQ at
// several nprobe), with each type's build time and size, on synthetic clustered unit vectors or on
// the vectors of an existing index file (the demo catalog's real embeddings).
// Every setting is timed twice in alternation on the same index: through moe::AnnIndex (what
// ann-query calls) and through FAISS called directly on the index file AnnIndex wrote, at the same
// setting; the ratio is the wrapper's cost. hnswlib (when its header was found at build time) builds
// its own graph at the same M / efConstruction and is searched at the same ef values. Every
// library runs on the same number of threads. Recall is against the exact top-k (FAISS's flat
// index).
#include <faiss/IVFlib.h>
#include <faiss/IndexFlat.h>
#include <faiss/IndexHNSW.h>
#include <faiss/IndexIVF.h>
#include <faiss/index_io.h>
#include <malloc.h>
#include <omp.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#if MOE_BENCH_HAVE_HNSWLIB
#include <hnswlib/hnswlib.h>
#endif

#include "bench_common.h"
#include "moe/ann_index.h"

// OpenBLAS (FAISS's flat search multiplies through BLAS above 20 queries) keeps its own thread
// count when it is the pthread build Debian selects by default; weak, so another BLAS links too.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace moe::bench {
namespace {

const char* kUsage =
    "usage: moe-bench-ann [options]\n"
    "  Recall@k vs queries/s of ann-query's index types: AnnIndex, FAISS called directly, hnswlib.\n"
    "  --n N              synthetic catalog vectors (default 1000000; --quick: 20000)\n"
    "  --dim N            synthetic width (default 512)\n"
    "  --base FILE        instead of synthetic vectors: those of this FAISS index file (one that can\n"
    "                     reconstruct its vectors: Flat, HNSW); the last --queries rows are the queries\n"
    "  --queries N        queries per search call, one call timed (default 200; --base: at most a fifth)\n"
    "  --k N              hits per query (default 10)\n"
    "  --types LIST       flat,hnsw,ivf-flat,ivf-pq (default all)\n"
    "  --threads N        threads for every library (default 1)\n"
    "  --hnsw-m N         HNSW links per node, FAISS and hnswlib (default 16)\n"
    "  --ef-construction N  HNSW build candidate list, FAISS and hnswlib (default 40)\n"
    "  --ef LIST          HNSW efSearch values (default 16,32,64,128,256)\n"
    "  --nlist N          IVF lists (default: the power of two nearest 4 sqrt(n))\n"
    "  --train-per-list N IVF training vectors per list (default 64; FAISS advises 30 to 256)\n"
    "  --pq CODE          IVF-PQ encoding, FAISS's spelling (default PQ64: 64 bytes per vector)\n"
    "  --nprobe LIST      IVF nprobe values (default 1,4,16,64)\n"
    "  --noise X          noise around each centre, relative to the centres' scale (default 1.75)\n"
    "  --reps N           timed samples, median reported (default 3)\n"
    "  --quick            20000 vectors\n"
    "  --json FILE        also write the results as JSON (tools/plot-ann.py draws them)\n";

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

// Top-k row numbers per query, whatever library produced them (-1: no hit).
using Labels = std::vector<int64_t>;

Labels rows_of(const std::vector<std::vector<AnnHit>>& hits, int k) {
  Labels out(hits.size() * static_cast<size_t>(k), -1);
  for (size_t q = 0; q < hits.size(); ++q)
    for (size_t i = 0; i < hits[q].size() && i < static_cast<size_t>(k); ++i)
      out[q * static_cast<size_t>(k) + i] = hits[q][i].item;
  return out;
}

double recall(const Labels& got, const Labels& truth, int k) {
  int64_t found = 0, total = 0;
  for (size_t q = 0; q * static_cast<size_t>(k) < truth.size(); ++q) {
    const auto row = [&](const Labels& l, int i) { return l[q * static_cast<size_t>(k) + static_cast<size_t>(i)]; };
    std::set<int64_t> want;
    for (int i = 0; i < k; ++i)
      if (row(truth, i) >= 0) want.insert(row(truth, i));
    for (int i = 0; i < k; ++i) found += want.count(row(got, i));
    total += static_cast<int64_t>(want.size());
  }
  return total ? static_cast<double>(found) / static_cast<double>(total) : 0;
}

// Resident memory of this process (bytes): what a build adds to it is the index's cost in RAM.
// Free heap pages go back to the system first, so that what an earlier index left is not reused
// unseen.
double resident_bytes() {
  malloc_trim(0);
  std::ifstream f("/proc/self/statm");
  long long pages = 0, resident = 0;
  f >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

double file_bytes(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 ? static_cast<double>(st.st_size) : 0;
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

// One line of the table: a library searching one index type at one setting.
struct Row {
  Row(std::string kind_, std::string params_, std::string setting_, std::string library_)
      : kind(std::move(kind_)),
        params(std::move(params_)),
        setting(std::move(setting_)),
        library(std::move(library_)) {}
  std::string kind, params, setting, library;  // library: AnnIndex, FAISS, hnswlib
  double recall = 0, qps = 0, build_s = 0, index_bytes = 0, resident_growth = 0;
  double vs_faiss = 0;  // AnnIndex only: time(FAISS) / time(AnnIndex), paired
  Sample timing;
};

struct Dataset {
  std::string description;
  int64_t n = 0, nq = 0;
  int dim = 0;
  std::vector<float> base, queries;
};

Dataset synthetic(int64_t n, int dim, int64_t nq, double noise) {
  Dataset d;
  const int64_t clusters = std::max<int64_t>(1, n / 100);
  d.n = n;
  d.nq = nq;
  d.dim = dim;
  d.description = std::to_string(n) + " synthetic vectors x " + std::to_string(dim) + " (unit length, around " +
                  std::to_string(clusters) + " random centres, uniform noise " + fmt(noise) +
                  " x the centres' scale, seeds 1-3), " + std::to_string(nq) + " queries from the same centres";
  const std::vector<float> centres = random_floats(static_cast<size_t>(clusters * dim), 1.0f, 1);
  d.base = clustered(n, dim, centres, static_cast<float>(noise), 2);
  d.queries = clustered(nq, dim, centres, static_cast<float>(noise), 3);
  return d;
}

// The vectors of an existing index file; the last nq rows (at most a fifth) are held out as queries.
Dataset from_index(const std::string& path, int64_t nq) {
  std::unique_ptr<faiss::Index> index(faiss::read_index(path.c_str()));
  const int64_t total = index->ntotal;
  if (total < 10) throw Error(path + ": " + std::to_string(total) + " vectors, too few to benchmark");
  Dataset d;
  d.dim = static_cast<int>(index->d);
  d.nq = std::min<int64_t>(nq, total / 5);
  d.n = total - d.nq;
  std::vector<float> all(static_cast<size_t>(total * d.dim));
  index->reconstruct_n(0, total, all.data());
  d.base.assign(all.begin(), all.begin() + d.n * d.dim);
  d.queries.assign(all.begin() + d.n * d.dim, all.end());
  d.description = std::to_string(d.n) + " vectors x " + std::to_string(d.dim) + " of " + path + " (its last " +
                  std::to_string(d.nq) + " rows held out as the queries)";
  return d;
}

#if MOE_BENCH_HAVE_HNSWLIB
// hnswlib at FAISS's HNSW settings: inner product (the vectors are unit length), same M and
// efConstruction, the same threads; rows added in order so that labels are row numbers.
void run_hnswlib(const Dataset& d, int k, int threads, int m, int ef_construction, const std::vector<int64_t>& efs,
                 const Labels& truth, const TimingOptions& t, std::vector<Row>& rows) {
  std::fprintf(stderr, "[hnswlib] building M %d, efConstruction %d ...\n", m, ef_construction);
  hnswlib::InnerProductSpace space(static_cast<size_t>(d.dim));
  const double rss0 = resident_bytes();
  std::unique_ptr<hnswlib::HierarchicalNSW<float>> graph;
  const double build_s = time_once(
      [&] {
        graph = std::make_unique<hnswlib::HierarchicalNSW<float>>(
            &space, static_cast<size_t>(d.n), static_cast<size_t>(m), static_cast<size_t>(ef_construction));
        graph->addPoint(d.base.data(), 0);  // the entry point first, as hnswlib's own examples do
#pragma omp parallel for num_threads(threads) schedule(dynamic, 256)
        for (int64_t i = 1; i < d.n; ++i)
          graph->addPoint(d.base.data() + i * d.dim, static_cast<hnswlib::labeltype>(i));
      },
      t);
  hnswlib::HierarchicalNSW<float>& index = *graph;
  const double growth = resident_bytes() - rss0;
  // What saveIndex() writes: the level-0 block (links, vector, label per element) and the upper
  // levels' link lists.
  double bytes = static_cast<double>(index.cur_element_count * index.size_data_per_element_);
  for (size_t i = 0; i < index.cur_element_count; ++i)
    bytes += static_cast<double>(index.element_levels_[i]) * static_cast<double>(index.size_links_per_element_);
  std::fprintf(stderr, "[hnswlib] built in %.1f s, %.1f MB\n", build_s, bytes / 1e6);

  const std::string params = "M=" + std::to_string(m) + ",efC=" + std::to_string(ef_construction);
  Labels got(static_cast<size_t>(d.nq * k), -1);
  for (int64_t ef : efs) {
    index.setEf(static_cast<size_t>(std::max<int64_t>(ef, k)));
    const auto search = [&] {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8)
      for (int64_t q = 0; q < d.nq; ++q) {
        auto result = index.searchKnn(d.queries.data() + q * d.dim, static_cast<size_t>(k));
        // A max-heap on distance (1 - inner product): popped worst first.
        for (int64_t i = static_cast<int64_t>(result.size()) - 1; i >= 0; --i, result.pop())
          got[static_cast<size_t>(q * k + i)] = static_cast<int64_t>(result.top().second);
      }
    };
    search();
    Row row{"hnsw", params, "ef=" + std::to_string(ef), "hnswlib"};
    row.recall = recall(got, truth, k);
    row.timing = time_calls(search, nullptr, t);
    row.qps = static_cast<double>(d.nq) / row.timing.median;
    row.build_s = build_s;
    row.index_bytes = bytes;
    row.resident_growth = growth;
    std::fprintf(stderr, "[hnswlib] ef=%lld: recall %.3f, %.0f q/s\n", static_cast<long long>(ef), row.recall, row.qps);
    rows.push_back(row);
  }
}
#endif

int run(int argc, char** argv) {
  Args args(argc, argv, kUsage);
  const bool quick = args.flag("quick");
  const std::string base_path = args.str("base", "");
  const int64_t n = args.integer("n", quick ? 20000 : 1000000);
  const int dim_arg = static_cast<int>(args.integer("dim", 512));
  const int64_t nq_arg = args.integer("queries", 200);
  const int k = static_cast<int>(args.integer("k", 10));
  const std::string type_list = args.str("types", "flat,hnsw,ivf-flat,ivf-pq");
  const int threads = static_cast<int>(args.integer("threads", 1));
  const int hnsw_m = static_cast<int>(args.integer("hnsw-m", 16));
  const int ef_construction = static_cast<int>(args.integer("ef-construction", 40));
  const int64_t nlist_arg = args.integer("nlist", 0);
  const int64_t train_per_list = args.integer("train-per-list", 64);
  const std::string pq = args.str("pq", "PQ64");
  const std::vector<int64_t> efs = args.int_list("ef", {16, 32, 64, 128, 256});
  const std::vector<int64_t> nprobes = args.int_list("nprobe", {1, 4, 16, 64});
  const double noise = args.number("noise", 1.75);
  TimingOptions t;
  t.reps = static_cast<int>(args.integer("reps", 3));
  t.warmup = 1;
  t.min_sample_s = 0.05;
  const std::string json_path = args.str("json", "");
  args.finish();
  if (n < 1 || dim_arg < 1 || nq_arg < 1 || k < 1 || threads < 1 || hnsw_m < 2 || ef_construction < 1 ||
      nlist_arg < 0 || train_per_list < 1)
    args.fail("sizes must be >= 1 (--hnsw-m >= 2)");

  // Every library on the same threads: FAISS's OpenMP loops, OpenBLAS under the flat search, and
  // the OpenMP loops this file runs hnswlib in.
  omp_set_num_threads(threads);
  if (openblas_set_num_threads) openblas_set_num_threads(threads);
  // On shared cores the wall clock measures the neighbours as much as the search; with every
  // library on one thread, CPU time is the search's own (wall clock with more threads).
  t.cpu_clock = threads == 1;
  const std::string clock_name = t.cpu_clock ? "CPU time (one thread)" : "wall-clock time";

  const Dataset d = base_path.empty() ? synthetic(n, dim_arg, nq_arg, noise) : from_index(base_path, nq_arg);
  int64_t pow2 = 1;
  while (pow2 * 2 <= static_cast<int64_t>(4 * std::sqrt(static_cast<double>(d.n)) * 1.41)) pow2 *= 2;
  const int64_t nlist = nlist_arg > 0 ? nlist_arg : pow2;
#if MOE_BENCH_HAVE_HNSWLIB
  const std::string hnswlib_status = "hnswlib: built (the hnswlib/hnswlib.h header, header-only)";
#else
  const std::string hnswlib_status = "hnswlib: not built (no hnswlib/hnswlib.h at build time; Debian: libhnswlib-dev)";
#endif
  std::printf("# moe-bench-ann\n\n%s, k %d; %d thread(s) for every library, timed on %s; %d samples per figure; %s\n",
              d.description.c_str(), k, threads, clock_name.c_str(), t.reps, hnswlib_status.c_str());

  std::vector<Kind> kinds;
  const auto wanted = [&](const std::string& name) {
    return ("," + type_list + ",").find("," + name + ",") != std::string::npos;
  };
  if (wanted("flat")) kinds.push_back({"flat", "Flat", {{"exact", {}}}});
  if (wanted("hnsw")) {
    Kind hnsw{"hnsw", "HNSW" + std::to_string(hnsw_m), {}};
    for (int64_t ef : efs) {
      AnnSearchOptions o;
      o.ef_search = static_cast<int>(ef);
      hnsw.settings.push_back({"ef=" + std::to_string(ef), o});
    }
    kinds.push_back(hnsw);
  }
  for (const std::string& ivf : {std::string("ivf-flat"), std::string("ivf-pq")}) {
    if (!wanted(ivf)) continue;
    Kind kind{ivf, "IVF" + std::to_string(nlist) + (ivf == "ivf-flat" ? ",Flat" : "," + pq), {}};
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

  // The exact top-k: FAISS's IndexFlatIP (BLAS above 20 queries).
  Labels truth(static_cast<size_t>(d.nq * k));
  {
    std::fprintf(stderr, "[truth] exact search ...\n");
    faiss::IndexFlatIP exact(d.dim);
    exact.add(d.n, d.base.data());
    std::vector<float> scores(truth.size());
    exact.search(d.nq, d.queries.data(), k, scores.data(), truth.data());
  }
  std::vector<AnnItem> items(static_cast<size_t>(d.n));
  for (int64_t i = 0; i < d.n; ++i) items[static_cast<size_t>(i)].id = std::to_string(i);

  std::vector<Row> rows;
  // The JSON report: written after every index type too (complete: false), so that a long run
  // stopped part way keeps what it measured.
  const auto write_report = [&](bool complete) {
    Json out = report_header("moe-bench-ann", quick);
    out.set("dataset", d.description);
    out.set("n", d.n);
    out.set("dim", d.dim);
    out.set("queries", d.nq);
    out.set("k", k);
    out.set("threads", threads);
    out.set("clock", clock_name);
    char load[64] = "";
    if (FILE* f = std::fopen("/proc/loadavg", "r")) {
      if (!std::fgets(load, sizeof load, f)) load[0] = '\0';
      std::fclose(f);
    }
    out.set("load_average_when_written", std::string(load, strcspn(load, "\n")));
    out.set("hnswlib", hnswlib_status);
    out.set("complete", complete);
    Json& results = out.set("results", Json::array());
    for (const Row& r : rows) {
      Json j = Json::object();
      j.set("index", r.kind);
      j.set("parameters", r.params);
      j.set("setting", r.setting);
      j.set("library", r.library);
      j.set("recall", r.recall);
      j.set("queries_per_s", r.qps);
      if (r.library == "AnnIndex") j.set("vs_faiss", r.vs_faiss);
      j.set("build_s", r.build_s);
      j.set("index_bytes", r.index_bytes);
      j.set("resident_growth_bytes", r.resident_growth);
      j.set("timing", sample_json(r.timing));
      results.push(j);
    }
    write_json(json_path, out);
  };
  for (const Kind& kind : kinds) {
    std::fprintf(stderr, "[%s] building %s ...\n", kind.name.c_str(), kind.factory.c_str());
    const double rss0 = resident_bytes();
    AnnBuildOptions build;
    build.index_type = kind.factory;
    build.ef_construction = ef_construction;
    build.train_size = std::min<int64_t>(d.n, train_per_list * nlist);
    AnnIndex index = AnnIndex::create(d.dim, {});
    const double build_s = time_once(
        [&] {
          index = AnnIndex::create(d.dim, build);
          index.add(d.base.data(), d.n, items);
          index.train();
        },
        t);
    const double growth = resident_bytes() - rss0;
    const std::string path = dir + "/" + kind.name + ".faiss";
    index.save(path);
    const double bytes = file_bytes(path);
    std::unique_ptr<faiss::Index> direct(faiss::read_index(path.c_str()));
    unlink(path.c_str());
    unlink((path + ".items.jsonl").c_str());
    std::fprintf(stderr, "[%s] built in %.1f s, %.1f MB\n", kind.name.c_str(), build_s, bytes / 1e6);
    const std::string params =
        kind.factory + (kind.name == "hnsw" ? ",efC=" + std::to_string(ef_construction) : std::string()) +
        (kind.name.rfind("ivf", 0) == 0 ? ",train=" + std::to_string(build.train_size) : std::string());

    for (const Setting& setting : kind.settings) {
      const Labels ann_rows = rows_of(index.search(d.queries.data(), d.nq, k, setting.options), k);
      std::vector<float> scores(static_cast<size_t>(d.nq * k));
      Labels labels(static_cast<size_t>(d.nq * k));
      // FAISS at the same setting, as its documentation shows it: efSearch on the HNSW index,
      // SearchParametersIVF for IVF.
      std::function<void()> faiss_search;
      if (kind.name == "hnsw") {
        auto* hnsw = static_cast<faiss::IndexHNSW*>(direct.get());
        hnsw->hnsw.efSearch = std::max(setting.options.ef_search, k);
        faiss_search = [&, hnsw] { hnsw->search(d.nq, d.queries.data(), k, scores.data(), labels.data()); };
      } else if (kind.name == "flat") {
        faiss_search = [&] { direct->search(d.nq, d.queries.data(), k, scores.data(), labels.data()); };
      } else {
        faiss::IndexIVF* ivf = faiss::ivflib::extract_index_ivf(direct.get());
        faiss_search = [&, ivf] {
          faiss::SearchParametersIVF search_params;
          search_params.nprobe = static_cast<size_t>(setting.options.nprobe);
          ivf->search(d.nq, d.queries.data(), k, scores.data(), labels.data(), &search_params);
        };
      }
      faiss_search();
      const PairedSample s =
          time_paired([&] { index.search(d.queries.data(), d.nq, k, setting.options); }, faiss_search, nullptr, t);
      Row ann{kind.name, params, setting.label, "AnnIndex"};
      ann.recall = recall(ann_rows, truth, k);
      ann.timing = s.a;
      ann.vs_faiss = 1.0 / s.ratio;
      Row faiss_row{kind.name, params, setting.label, "FAISS"};
      faiss_row.recall = recall(labels, truth, k);
      faiss_row.timing = s.b;
      for (Row* r : {&ann, &faiss_row}) {
        r->qps = static_cast<double>(d.nq) / r->timing.median;
        r->build_s = build_s;
        r->index_bytes = bytes;
        r->resident_growth = growth;
      }
      std::fprintf(stderr, "[%s] %s: recall %.3f, AnnIndex %.0f q/s, FAISS %.0f q/s\n", kind.name.c_str(),
                   setting.label.c_str(), ann.recall, ann.qps, faiss_row.qps);
      rows.push_back(ann);
      rows.push_back(faiss_row);
    }
#if MOE_BENCH_HAVE_HNSWLIB
    if (kind.name == "hnsw") {
      // FAISS's graph is freed first, so that hnswlib's resident growth is its own.
      direct.reset();
      index = AnnIndex::create(d.dim, {});
      run_hnswlib(d, k, threads, hnsw_m, ef_construction, efs, truth, t, rows);
    }
#endif
    write_report(false);
  }
  rmdir(dir.c_str());

  Table table({"index", "parameters", "setting", "library", "recall@" + std::to_string(k), "queries/s",
               "vs FAISS direct", "build s", "index MB", "RSS growth MB", "spread"});
  for (const Row& r : rows)
    table.add({r.kind, r.params, r.setting, r.library, fmt(r.recall), fmt(r.qps),
               r.library == "AnnIndex" ? fmt_ratio(r.vs_faiss) : std::string("-"), fmt(r.build_s),
               fmt(r.index_bytes / 1e6), fmt(r.resident_growth / 1e6), fmt_pct(r.timing.spread())});
  std::printf("\n");
  table.print();
  std::printf(
      "\nqueries/s and build s: on %s. recall@%d: share of the exact top-%d found. vs FAISS direct: median over "
      "alternated samples of "
      "time(FAISS) / time(AnnIndex) on the same index file at the same setting (1x: no overhead). build s: "
      "create + add + train (AnnIndex; FAISS direct searches the file it wrote). index MB: the FAISS file's "
      "size (hnswlib: what saveIndex writes). RSS growth: what the build added to the process's resident "
      "memory (AnnIndex: with its item table).\n",
      clock_name.c_str(), k, k);
  write_report(true);
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  return moe::bench::guarded_main([&] { return moe::bench::run(argc, argv); });
}
