// moe-bench-preload: the expert cache's preload (prefetch of batch N+1 issued while batch N
// computes) against no preload (each batch's prefetch right before its compute), with a cache
// that holds half the experts and a skewed (Zipf) routing distribution.
//
// Every mode runs the same sequence of routed batches on the same backend:
//   off       lease = prefetch(batch n); compute n (acquire waits for its copies); release
//   on        prefetch(batch n+1) is issued, then batch n computes while its copies run on the
//             copy queue; release n. If n+1 does not fit beside n's pinned experts, its
//             prefetch is deferred until n is released (counted: "deferred").
//   resident  a cache with a slot for every expert, all loaded before timing: no copies at
//             all, the ceiling preload can approach.
// Compute of a batch = upload ids and weights, moe_permute, acquire each expert with rows,
// grouped_swiglu, moe_unpermute, copy the result to the host (which ends the batch).
// The CPU backend runs with async_copies (a worker thread is its copy queue), so copies cost
// real time and overlap compute on another core; on cuda:0 they run on the copy stream.
#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.h"
#include "moe/expert_cache.h"
#include "moe/expert_store.h"

namespace moe::bench {
namespace {

const char* kUsage =
    "usage: moe-bench-preload [options]\n"
    "  Expert-cache preload on vs off under Zipf routing; cache = half the experts.\n"
    "  --quick            16 experts of 24 MiB (hidden 1024, inter 2048, f32), 2 tokens/batch, 24 batches\n"
    "                     (f32: the CPU backend widens f16/bf16 weights on every call, which would swamp\n"
    "                     the copies this measures)\n"
    "                     (default: 64 experts of 48 MiB (hidden 2048, inter 4096, f16), 8 tokens/batch, 200)\n"
    "  --device LIST      auto (cpu, + cuda:0 when present) | cpu | cuda:N, comma-separated\n"
    "  --experts N --hidden N --inter N --precision f32|f16|bf16\n"
    "  --slots N          cache slots (default experts / 2)\n"
    "  --tokens N         tokens per batch (default see above; tokens × top-k must be <= slots)\n"
    "  --top-k N          experts per token (default 2)\n"
    "  --zipf S           routing skew: P(rank r) ∝ r^-S (default 1.1)\n"
    "  --batches N        timed batches per run (after --warmup-batches, default 8 / 20)\n"
    "  --reps N           runs per mode, median reported (default 5)\n"
    "  --json FILE        also write the results as JSON\n";

struct Params {
  int E, slots, k, tokens;
  int64_t d, I;
  kernels::WeightType type;
  std::string precision;
  double zipf;
  int warmup, batches, reps;
};

struct Batch {
  std::vector<int32_t> ids;      // [tokens, k]
  std::vector<float> weights;    // [tokens, k]
  std::vector<int32_t> experts;  // distinct, ascending
};

// Zipf-distributed routing: expert popularity ∝ rank^-s, ranks assigned to experts by a fixed
// random permutation; each token picks k distinct experts.
std::vector<Batch> make_batches(const Params& p, int count, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> expert_of_rank(static_cast<size_t>(p.E));
  for (int i = 0; i < p.E; ++i) expert_of_rank[static_cast<size_t>(i)] = i;
  for (int i = p.E - 1; i > 0; --i)
    std::swap(expert_of_rank[static_cast<size_t>(i)], expert_of_rank[rng.next() % (i + 1)]);
  std::vector<double> cdf(static_cast<size_t>(p.E));
  double sum = 0;
  for (int r = 0; r < p.E; ++r) cdf[static_cast<size_t>(r)] = (sum += std::pow(r + 1.0, -p.zipf));
  std::vector<Batch> out(static_cast<size_t>(count));
  for (Batch& b : out) {
    for (int t = 0; t < p.tokens; ++t) {
      std::vector<int32_t> chosen;
      while (static_cast<int>(chosen.size()) < p.k) {
        const double u = rng.uniform() * sum;
        const size_t r = static_cast<size_t>(std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
        const int32_t e = expert_of_rank[std::min(r, cdf.size() - 1)];
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      float wsum = 0;
      std::vector<float> w(static_cast<size_t>(p.k));
      for (float& v : w) wsum += (v = 0.5f + static_cast<float>(rng.uniform()));
      for (int j = 0; j < p.k; ++j) {
        b.ids.push_back(chosen[static_cast<size_t>(j)]);
        b.weights.push_back(w[static_cast<size_t>(j)] / wsum);
      }
    }
    b.experts = b.ids;
    std::sort(b.experts.begin(), b.experts.end());
    b.experts.erase(std::unique(b.experts.begin(), b.experts.end()), b.experts.end());
  }
  return out;
}

struct RunResult {
  double seconds = 0;
  uint64_t hits = 0, misses = 0, bytes = 0, exposed = 0, hidden = 0, exposed_ns = 0, deferred = 0;
};

struct ModeResult {
  std::string mode;
  std::vector<RunResult> runs;
  RunResult median_run() const {  // the run with the median time (its counters come along)
    std::vector<RunResult> r = runs;
    std::sort(r.begin(), r.end(), [](const RunResult& a, const RunResult& b) { return a.seconds < b.seconds; });
    return r[r.size() / 2];
  }
};

class Rig {
 public:
  Rig(kernels::Backend& b, const Params& p, const HostExpertStore& store)
      : b_(b),
        p_(p),
        store_(store),
        x_(b, random_floats(static_cast<size_t>(p.tokens * p.d), 1.0f, 5).data(),
           static_cast<size_t>(p.tokens * p.d) * sizeof(float)),
        ids_(b, static_cast<size_t>(p.tokens * p.k) * sizeof(int32_t)),
        w_(b, static_cast<size_t>(p.tokens * p.k) * sizeof(float)),
        slot_of_(b, static_cast<size_t>(p.tokens * p.k) * sizeof(int32_t)),
        xs_(b, static_cast<size_t>(p.tokens * p.k * p.d) * sizeof(float)),
        outs_(b, static_cast<size_t>(p.tokens * p.k * p.d) * sizeof(float)),
        y_(b, static_cast<size_t>(p.tokens * p.d) * sizeof(float)),
        yh_(static_cast<size_t>(p.tokens * p.d)) {}

  void compute(const Batch& batch, BatchLease& lease) {
    b_.copy_from_host(ids_.get(), batch.ids.data(), batch.ids.size() * sizeof(int32_t));
    b_.copy_from_host(w_.get(), batch.weights.data(), batch.weights.size() * sizeof(float));
    const std::vector<int64_t> offsets = b_.moe_permute(ids_.get<int32_t>(), p_.tokens, p_.k, p_.E, x_.get<float>(),
                                                        p_.d, xs_.get<float>(), slot_of_.get<int32_t>());
    std::vector<kernels::ExpertWeights> ew(static_cast<size_t>(p_.E));
    for (int e = 0; e < p_.E; ++e)
      if (offsets[static_cast<size_t>(e) + 1] > offsets[static_cast<size_t>(e)])
        ew[static_cast<size_t>(e)] = lease.acquire(e);
    b_.grouped_swiglu(xs_.get<float>(), offsets, ew, p_.d, p_.I, outs_.get<float>());
    b_.moe_unpermute(outs_.get<float>(), slot_of_.get<int32_t>(), w_.get<float>(), p_.tokens, p_.k, p_.d,
                     y_.get<float>());
    b_.copy_to_host(yh_.data(), y_.get(), yh_.size() * sizeof(float));  // ends the batch
  }

  // One run of `mode` over warm-up + timed batches with a fresh cache.
  RunResult run(const std::string& mode, const std::vector<Batch>& batches) {
    ExpertCacheOptions opt;
    const int slots = mode == "resident" ? p_.E : p_.slots;
    opt.budget_bytes = static_cast<size_t>(slots) * store_.max_expert_bytes();
    ExpertCache cache(b_, store_, opt);
    if (mode == "resident") {  // load every expert, wait for the copies
      std::vector<int32_t> all(static_cast<size_t>(p_.E));
      for (int e = 0; e < p_.E; ++e) all[static_cast<size_t>(e)] = e;
      auto lease = cache.prefetch(all);
      for (int e = 0; e < p_.E; ++e) lease->acquire(e);
      b_.synchronize();
      lease->release();
    }
    RunResult r;
    CacheStats before{};
    Clock::time_point t0{};
    uint64_t deferred = 0;
    const size_t n_total = batches.size();
    std::shared_ptr<BatchLease> next;
    const size_t warmup = static_cast<size_t>(p_.warmup);
    // The counters cover the prefetches of the timed batches: with preload, batch n's
    // prefetch is issued during batch n-1, so the snapshot is taken just before it.
    auto snapshot = [&] {
      before = cache.stats();
      deferred = 0;
    };
    if (mode == "on") {
      if (warmup == 0) snapshot();
      next = cache.prefetch(batches[0].experts);
    }
    for (size_t n = 0; n < n_total; ++n) {
      if (n == warmup) {
        if (mode != "on") snapshot();
        t0 = Clock::now();
      }
      std::shared_ptr<BatchLease> cur;
      bool defer = false;
      if (mode == "on") {
        cur = std::move(next);
        if (n + 1 == warmup) snapshot();
        if (n + 1 < n_total) {
          try {
            next = cache.prefetch(batches[n + 1].experts);  // copies run while batch n computes
          } catch (const Error&) {
            defer = true;  // n+1 does not fit beside n's pinned experts: after n is released
            ++deferred;
          }
        }
      } else {
        cur = cache.prefetch(batches[n].experts);
      }
      compute(batches[n], *cur);
      cur->release();
      if (defer) next = cache.prefetch(batches[n + 1].experts);
    }
    b_.synchronize();
    r.seconds = seconds_since(t0);
    const CacheStats after = cache.stats();
    r.hits = after.hits - before.hits;
    r.misses = after.misses - before.misses;
    r.bytes = after.bytes_copied - before.bytes_copied;
    r.exposed = after.copies_exposed - before.copies_exposed;
    r.hidden = after.copies_hidden - before.copies_hidden;
    r.exposed_ns = after.exposed_wait_ns - before.exposed_wait_ns;
    r.deferred = deferred;
    return r;
  }

 private:
  kernels::Backend& b_;
  const Params& p_;
  const HostExpertStore& store_;
  DeviceBuffer x_, ids_, w_, slot_of_, xs_, outs_, y_;
  std::vector<float> yh_;
};

int run(int argc, char** argv) {
  Args args(argc, argv, kUsage);
  const bool quick = args.flag("quick");
  const std::string device_spec = args.str("device", "auto");
  Params p;
  p.E = static_cast<int>(args.integer("experts", quick ? 16 : 64));
  p.slots = static_cast<int>(args.integer("slots", p.E / 2));
  p.d = args.integer("hidden", quick ? 1024 : 2048);
  p.I = args.integer("inter", quick ? 2048 : 4096);
  p.precision = args.str("precision", quick ? "f32" : "f16");
  p.k = static_cast<int>(args.integer("top-k", 2));
  p.tokens = static_cast<int>(args.integer("tokens", quick ? 2 : 8));
  p.zipf = args.number("zipf", 1.1);
  p.warmup = static_cast<int>(args.integer("warmup-batches", quick ? 8 : 20));
  p.batches = static_cast<int>(args.integer("batches", quick ? 24 : 200));
  p.reps = static_cast<int>(args.integer("reps", 5));
  const std::string json_path = args.str("json", "");
  args.finish();
  p.type = parse_precision(p.precision);
  if (p.E < 2 || p.slots < 1 || p.slots > p.E || p.k < 1 || p.k > p.E || p.tokens < 1 || p.batches < 1 || p.reps < 1 ||
      p.warmup < 0 || p.d < 1 || p.I < 1)
    args.fail("invalid sizes");
  if (p.tokens * p.k > p.slots)
    args.fail("tokens × top-k (" + std::to_string(p.tokens * p.k) + ") exceeds the cache's " + std::to_string(p.slots) +
              " slots: a batch could need more experts than the cache holds");

  const std::vector<std::string> devices = resolve_devices(device_spec);
  const std::vector<Batch> batches = make_batches(p, p.warmup + p.batches, 2024);
  double distinct = 0;
  for (size_t n = static_cast<size_t>(p.warmup); n < batches.size(); ++n)
    distinct += static_cast<double>(batches[n].experts.size());
  distinct /= p.batches;

  // A few distinct random matrices, reused across experts: copy and GEMM speed do not depend
  // on the values, and generating gigabytes of random numbers would dominate the run.
  const int pool = 4;
  std::vector<std::array<Tensor, 3>> mats(pool);
  for (int i = 0; i < pool; ++i)
    for (int m = 0; m < 3; ++m) {
      const bool down = m == 2;
      Tensor t = Tensor::zeros(DType::F32, down ? Shape{p.d, p.I} : Shape{p.I, p.d});
      fill_uniform(t.data<float>(), static_cast<size_t>(t.numel()),
                   1.0f / std::sqrt(static_cast<float>(down ? p.I : p.d)), 300 + 3 * i + m);
      mats[static_cast<size_t>(i)][static_cast<size_t>(m)] = t;
    }

  std::printf(
      "# moe-bench-preload\n\n%d experts (hidden %lld, inter %lld, %s), cache %d slots, top-%d, %d "
      "tokens/batch (%.1f distinct experts/batch on average), Zipf s=%.2f; %d warm-up + %d timed batches per "
      "run, median of %d runs per mode (modes interleaved)\n",
      p.E, static_cast<long long>(p.d), static_cast<long long>(p.I), p.precision.c_str(), p.slots, p.k, p.tokens,
      distinct, p.zipf, p.warmup, p.batches, p.reps);

  struct DeviceResult {
    std::string device;
    size_t expert_bytes;
    std::vector<ModeResult> modes;
  };
  std::vector<DeviceResult> results;
  const std::vector<std::string> modes = {"off", "on", "resident"};
  for (const std::string& device : devices) {
    std::unique_ptr<kernels::Backend> b = make_backend(device, true);
    const Clock::time_point t0 = Clock::now();
    HostExpertStore store(*b, p.type, p.E, p.d, p.I, [&](int e, ExpertMatrix w) {
      return mats[static_cast<size_t>(e % pool)][static_cast<size_t>(w)];
    });
    std::fprintf(stderr, "[%s] packed %d experts of %.1f MiB in %.1f s\n", device.c_str(), p.E,
                 static_cast<double>(store.max_expert_bytes()) / (1 << 20), seconds_since(t0));
    Rig rig(*b, p, store);
    DeviceResult dr{device, store.max_expert_bytes(), {}};
    for (const std::string& m : modes) dr.modes.push_back({m, {}});
    // Modes interleaved, in a rotating order, so that drift and neighbours touch all alike.
    for (int rep = 0; rep < p.reps; ++rep)
      for (size_t i = 0; i < dr.modes.size(); ++i) {
        ModeResult& mr = dr.modes[(i + static_cast<size_t>(rep)) % dr.modes.size()];
        mr.runs.push_back(rig.run(mr.mode, batches));
        std::fprintf(stderr, "[%s] run %d %-8s %.3f s\n", device.c_str(), rep + 1, mr.mode.c_str(),
                     mr.runs.back().seconds);
      }
    results.push_back(std::move(dr));
  }

  Table table({"device", "preload", "batches/s", "ms/batch", "vs off", "hit rate", "copies/batch", "MiB/batch",
               "exposed copies", "exposed wait ms/batch", "deferred"});
  Json out = report_header("moe-bench-preload", quick);
  Json& cfg = out.set("config", Json::object());
  cfg.set("experts", p.E);
  cfg.set("slots", p.slots);
  cfg.set("hidden", p.d);
  cfg.set("intermediate", p.I);
  cfg.set("precision", p.precision);
  cfg.set("top_k", p.k);
  cfg.set("tokens_per_batch", p.tokens);
  cfg.set("zipf_s", p.zipf);
  cfg.set("warmup_batches", p.warmup);
  cfg.set("timed_batches", p.batches);
  cfg.set("runs_per_mode", p.reps);
  cfg.set("mean_distinct_experts_per_batch", distinct);
  out.set("baseline", "preload off (prefetch right before compute), same batches, same process");
  Json& res = out.set("results", Json::array());
  for (const DeviceResult& dr : results) {
    for (const ModeResult& mr : dr.modes) {
      const RunResult r = mr.median_run();
      const double bps = p.batches / r.seconds;
      // Paired ratio: run i of this mode against run i of "off" (same repetition, adjacent in
      // time), median over repetitions.
      std::vector<double> ratios;
      for (size_t i = 0; i < mr.runs.size(); ++i) ratios.push_back(dr.modes[0].runs[i].seconds / mr.runs[i].seconds);
      const double vs_off = median_of(ratios);
      const double copies = static_cast<double>(r.misses);
      table.add(
          {dr.device, mr.mode, fmt(bps), fmt(1e3 / bps), fmt_ratio(vs_off),
           r.hits + r.misses ? fmt_pct(static_cast<double>(r.hits) / static_cast<double>(r.hits + r.misses)) : "n/a",
           fmt(copies / p.batches), fmt(static_cast<double>(r.bytes) / (1 << 20) / p.batches),
           copies > 0 ? fmt_pct(static_cast<double>(r.exposed) / copies) : "-",
           fmt(static_cast<double>(r.exposed_ns) / 1e6 / p.batches), std::to_string(r.deferred)});
      Json j = Json::object();
      j.set("device", dr.device);
      j.set("mode", mr.mode);
      j.set("expert_bytes", static_cast<uint64_t>(dr.expert_bytes));
      j.set("batches_per_s", bps);
      j.set("ratio_vs_off", vs_off);
      j.set("hits", r.hits);
      j.set("misses", r.misses);
      j.set("bytes_copied", r.bytes);
      j.set("copies_exposed", r.exposed);
      j.set("copies_hidden", r.hidden);
      j.set("exposed_wait_ns", r.exposed_ns);
      j.set("deferred_prefetches", r.deferred);
      Json secs = Json::array();
      for (const RunResult& rr : mr.runs) secs.push(rr.seconds);
      j.set("run_seconds", secs);
      res.push(j);
    }
  }
  std::printf("expert size: %.1f MiB\n\n",
              results.empty() ? 0.0 : static_cast<double>(results[0].expert_bytes) / (1 << 20));
  table.print();
  std::printf(
      "\nvs off = time without preload ÷ time of this mode, median over repetitions of adjacent runs "
      "(same batches, same process). exposed copies = share of "
      "copies still running at their first acquire; exposed wait = host time acquire() blocked (CPU: the "
      "whole stall; CUDA: ~0, the stream waits, not the host). resident = every expert in the cache, no "
      "copies: the ceiling.\n");
  write_json(json_path, out);
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  return moe::bench::guarded_main([&] { return moe::bench::run(argc, argv); });
}
