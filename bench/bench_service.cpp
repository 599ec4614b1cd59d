// moe-bench-service: the query service (pipelines/serve.sh, already running) against the engine
// called directly on the same model, adapter and index (docs/benchmarks.md, "Service against the
// engine"; tools/bench-service.sh starts the service and runs this).
//
// For each load L (--inflight, default 1,8,32), two measurements side by side, so that both
// see the same neighbours, repeated in --rounds rounds over all loads:
//  - direct: the query texts through ClipModel::encode_texts -> MoeAdapter::apply ->
//    AnnIndex::search in this process, L texts per call; a query's latency is its call's.
//  - service: the same texts as JSON requests PUSHed to the service with L in flight (a closed
//    loop: each answer read from the result stream sends the next request); a query's latency
//    runs from its send to its answer.
// Each runs --warmup seconds untimed, then --seconds timed; queries/s counts the answers (or
// queries) completed in the timed window, p50/p99 their latencies. Every figure is the median
// over the rounds, and every ratio the median of the rounds' paired ratios. The ratios against
// the service targets (issue 12) are printed under the table, with a second table of where the time
// goes: per stage, the service's timings_ms against the same engine calls timed in the direct run.
//
// --write-vit-b32 DIR writes the models of tools/bench-service.sh --vit-b32 and exits: DIR/clip, a
// synthetic CLIP ViT-B/32 (random weights, bench/clip_writer.h, seed 42: moe-bench-peer-worker's)
// without tokenizer files (the script copies CLIP's), and DIR/adapter, a synthetic adapter for it
// (512 wide, 8 experts of width 2048, top-2, seed 43: moe-bench-memory's).
#include <json-glib/json-glib.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <zmq.hpp>

#include "bench_common.h"
#include "clip_writer.h"
#include "moe/ann_index.h"
#include "moe/clip_model.h"
#include "moe/moe_layer.h"

namespace moe::bench {
namespace {

const char* const kUsage =
    "moe-bench-service --model DIR --adapter DIR --index FILE [--requests EP] [--results EP]\n"
    "                  [--queries FILE] [--inflight 1,8,32] [--rounds 3] [--seconds 10] [--warmup 2] [--k 10]\n"
    "                  [--json FILE]\n"
    "moe-bench-service --write-vit-b32 DIR\n"
    "\n"
    "Measures a running query service (zmq-query on --requests, zmq-publish on --results; default\n"
    "tcp://127.0.0.1:5555 and :5556) and the engine called directly on the same model, adapter and\n"
    "index, at each load of --inflight (queries in flight; the direct batch size). --queries is a\n"
    "JSON-lines file of {\"text\": ...} objects (default: the shipped models/default/queries.jsonl).\n"
    "\n"
    "--write-vit-b32 DIR writes a synthetic CLIP ViT-B/32 (random weights, no tokenizer files) to DIR/clip\n"
    "and a synthetic MoE adapter for it (512 wide, 8 experts of width 2048, top-2) to DIR/adapter, and exits.\n";

// Where a query's time goes, per stage, in both measurements: the service's timings_ms (route and
// expert summed as "adapter") and the direct call's own timing of the same three engine calls.
const char* const kStages[] = {"queue", "encode", "adapter", "search"};
constexpr size_t kStageCount = sizeof(kStages) / sizeof(kStages[0]);
using StageMs = std::array<double, kStageCount>;  // NaN: the stage was not reported
StageMs no_stages() {
  StageMs s;
  s.fill(std::nan(""));
  return s;
}

// The measured latencies of one run, and how many queries finished in its timed window.
struct Run {
  std::vector<double> latency_ms;
  std::vector<double> pipeline_ms;  // service: each answer's timings_ms.total (its time inside the pipeline)
  std::array<std::vector<double>, kStageCount> stage_ms;  // per query (direct: per call), per stage
  std::vector<double> batch_rows;  // service: each answer's cost.batch_rows (the batch moe-encode formed)
  void add_stages(const StageMs& s) {
    for (size_t i = 0; i < kStageCount; ++i)
      if (!std::isnan(s[i])) stage_ms[i].push_back(s[i]);
  }
  double seconds = 0;
  int64_t errors = 0;  // error documents (service)
  double qps() const { return static_cast<double>(latency_ms.size()) / seconds; }
};

// Nearest-rank percentile.
double percentile(std::vector<double> v, double p) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
  return v[std::min(v.size(), std::max<size_t>(rank, 1)) - 1];
}

std::vector<std::string> read_texts(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw Error("cannot read queries file " + path);
  std::vector<std::string> texts;
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    JsonParser* parser = json_parser_new();
    GError* err = nullptr;
    if (json_parser_load_from_data(parser, line.c_str(), static_cast<gssize>(line.size()), &err)) {
      JsonNode* root = json_parser_get_root(parser);
      if (JSON_NODE_HOLDS_OBJECT(root) && json_object_has_member(json_node_get_object(root), "text"))
        texts.emplace_back(json_object_get_string_member(json_node_get_object(root), "text"));
    } else {
      g_error_free(err);
    }
    g_object_unref(parser);
  }
  if (texts.empty()) throw Error(path + " holds no {\"text\": ...} lines");
  return texts;
}

/* ----- direct ----- */

struct Engine {
  ClipModel clip;
  MoeAdapter adapter;
  AnnIndex index;
};

// `batch` texts per call, round-robin over `texts`.
Run run_direct(const Engine& engine, const std::vector<std::string>& texts, int64_t batch, int k, double warmup_s,
               double seconds) {
  Run run;
  size_t next = 0;
  StageMs stages = no_stages();
  const auto call = [&] {
    std::vector<std::string> b;
    for (int64_t i = 0; i < batch; ++i, next = (next + 1) % texts.size()) b.push_back(texts[next]);
    const Clock::time_point t0 = Clock::now();
    const Tensor embeds = engine.clip.encode_texts(b).embeds;
    const Clock::time_point t1 = Clock::now();
    const AdapterOutput out = engine.adapter.apply(embeds);
    const Clock::time_point t2 = Clock::now();
    engine.index.search(out.embeddings.data<float>(), batch, k);
    const Clock::time_point t3 = Clock::now();
    const auto ms = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    stages = {0, ms(t0, t1), ms(t1, t2), ms(t2, t3)};
    return ms(t0, t3);
  };
  for (const Clock::time_point start = Clock::now(); seconds_since(start) < warmup_s;) call();
  const Clock::time_point start = Clock::now();
  while (seconds_since(start) < seconds) {
    const double ms = call();
    run.latency_ms.insert(run.latency_ms.end(), static_cast<size_t>(batch), ms);
    run.add_stages(stages);
  }
  run.seconds = seconds_since(start);
  return run;
}

/* ----- service ----- */

class ServiceClient {
 public:
  ServiceClient(const std::string& requests, const std::string& results, int k)
      : push_(ctx_, zmq::socket_type::push), sub_(ctx_, zmq::socket_type::sub), k_(k) {
    sub_.set(zmq::sockopt::subscribe, "");
    sub_.connect(results);
    push_.set(zmq::sockopt::linger, 0);
    push_.connect(requests);
  }

  // Sends probes until one is answered: the service is up and the subscription reached it.
  void wait_ready(double timeout_s) {
    const Clock::time_point start = Clock::now();
    for (int i = 0; seconds_since(start) < timeout_s; ++i) {
      const std::string id = "ready-" + std::to_string(i);
      send(id, "ready");
      const Clock::time_point sent = Clock::now();
      while (seconds_since(sent) < 0.25) {
        Answer a;
        if (receive(50, &a) && a.id.rfind("ready-", 0) == 0) {
          drain(1.0);
          return;
        }
      }
    }
    throw Error("the service did not answer within " + fmt(timeout_s) + " s");
  }

  // A closed loop with `inflight` requests outstanding: warm-up, then the timed window, then
  // the answers still due are awaited (so the next run starts with none in flight).
  Run run(const std::vector<std::string>& texts, int64_t inflight, double warmup_s, double seconds) {
    Run run;
    std::map<std::string, Clock::time_point> outstanding;
    size_t next = 0;
    const auto send_next = [&] {
      const std::string id = "q" + std::to_string(serial_++);
      outstanding[id] = Clock::now();
      send(id, texts[next]);
      next = (next + 1) % texts.size();
    };
    const auto after = [](Clock::time_point t, double s) {
      return t + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
    };
    const Clock::time_point window = after(Clock::now(), warmup_s), end = after(window, seconds);
    for (int64_t i = 0; i < inflight; ++i) send_next();
    Clock::time_point last_answer = Clock::now();
    while (!outstanding.empty()) {
      Answer a;
      if (!receive(100, &a)) {
        if (seconds_since(last_answer) > 30) throw Error("the service stopped answering (30 s without a result)");
        continue;
      }
      const auto it = outstanding.find(a.id);
      if (it == outstanding.end()) continue;  // a late probe, or someone else's
      const Clock::time_point now = Clock::now();
      last_answer = now;
      if (now >= window && now < end) {
        run.latency_ms.push_back(std::chrono::duration<double, std::milli>(now - it->second).count());
        if (!std::isnan(a.pipeline_ms)) run.pipeline_ms.push_back(a.pipeline_ms);
        run.add_stages(a.stage_ms);
        if (!std::isnan(a.batch_rows)) run.batch_rows.push_back(a.batch_rows);
        run.errors += a.error;
      }
      outstanding.erase(it);
      if (now < end) send_next();
    }
    run.seconds = std::chrono::duration<double>(end - window).count();
    return run;
  }

 private:
  void send(const std::string& id, const std::string& text) {
    Json request = Json::object();
    request.set("id", id);
    request.set("text", text);
    request.set("k", k_);
    const std::string s = request.dump();
    push_.send(zmq::buffer(s), zmq::send_flags::none);
  }

  // What the bench reads from a result document.
  struct Answer {
    std::string id;
    bool error = false;                 // an error document
    double pipeline_ms = std::nan("");  // timings_ms.total
    StageMs stage_ms = no_stages();     // timings_ms per stage (route + expert as "adapter")
    double batch_rows = std::nan("");   // cost.batch_rows
  };

  // One result document within `timeout_ms`.
  bool receive(int timeout_ms, Answer* answer) {
    zmq::pollitem_t item{sub_.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(timeout_ms)) == 0) return false;
    zmq::message_t msg;
    bool more = true;
    while (more) {  // the last frame is the document (the first, with a topic, is the topic)
      if (!sub_.recv(msg, zmq::recv_flags::none)) return false;
      more = msg.more();
    }
    JsonParser* parser = json_parser_new();
    bool ok = json_parser_load_from_data(parser, static_cast<const char*>(msg.data()), static_cast<gssize>(msg.size()),
                                         nullptr);
    JsonNode* root = ok ? json_parser_get_root(parser) : nullptr;
    ok = root != nullptr && JSON_NODE_HOLDS_OBJECT(root);
    if (ok) {
      JsonObject* doc = json_node_get_object(root);
      const char* id = json_object_has_member(doc, "id") ? json_object_get_string_member(doc, "id") : nullptr;
      const char* type = json_object_has_member(doc, "type") ? json_object_get_string_member(doc, "type") : nullptr;
      answer->id = id != nullptr ? id : "";
      answer->error = g_strcmp0(type, "error") == 0;
      JsonObject* timings =
          json_object_has_member(doc, "timings_ms") ? json_object_get_object_member(doc, "timings_ms") : nullptr;
      const auto timing = [timings](const char* stage) {
        return timings != nullptr && json_object_has_member(timings, stage)
                   ? json_object_get_double_member(timings, stage)
                   : std::nan("");
      };
      answer->pipeline_ms = timing("total");
      // An adapter-less service (ADAPTER=none) reports neither route nor expert.
      const double route = timing("route"), expert = timing("expert");
      answer->stage_ms = {timing("queue"), timing("encode"),
                          std::isnan(route) && std::isnan(expert)
                              ? std::nan("")
                              : (std::isnan(route) ? 0 : route) + (std::isnan(expert) ? 0 : expert),
                          timing("search")};
      JsonObject* cost =
          json_object_has_member(doc, "cost") && JSON_NODE_HOLDS_OBJECT(json_object_get_member(doc, "cost"))
              ? json_object_get_object_member(doc, "cost")
              : nullptr;
      if (cost != nullptr && json_object_has_member(cost, "batch_rows"))
        answer->batch_rows = json_object_get_double_member(cost, "batch_rows");
    }
    g_object_unref(parser);
    return ok;
  }

  // Reads and forgets results for `seconds` (answers to the other probes).
  void drain(double seconds) {
    const Clock::time_point start = Clock::now();
    Answer ignored;
    while (seconds_since(start) < seconds) receive(50, &ignored);
  }

  zmq::context_t ctx_;
  zmq::socket_t push_, sub_;
  int k_;
  uint64_t serial_ = 0;
};

void write_vit_b32(const std::string& dir) {
  const ClipShape shape = ClipShape::vit_b32();
  std::filesystem::create_directories(dir + "/clip");
  std::filesystem::create_directories(dir + "/adapter");
  write_random_clip(dir + "/clip", shape, 42);
  write_random_adapter(dir + "/adapter", shape.projection_dim, 8, 2, 2048, 43);
}

int run(int argc, char** argv) {
  Args args(argc, argv, kUsage);
  const std::string write_dir = args.str("write-vit-b32", "");
  const std::string model = args.str("model", ""), adapter = args.str("adapter", ""), index = args.str("index", "");
  const std::string requests = args.str("requests", "tcp://127.0.0.1:5555");
  const std::string results = args.str("results", "tcp://127.0.0.1:5556");
  const std::string queries = args.str("queries", std::string(MOE_SOURCE_DIR) + "/models/default/queries.jsonl");
  const std::vector<int64_t> loads = args.int_list("inflight", {1, 8, 32});
  const int64_t rounds = args.integer("rounds", 3);
  const double seconds = args.number("seconds", 10), warmup = args.number("warmup", 2);
  const int k = static_cast<int>(args.integer("k", 10));
  const std::string json_path = args.str("json", "");
  args.finish();
  if (!write_dir.empty()) {
    write_vit_b32(write_dir);
    return 0;
  }
  if (model.empty() || adapter.empty() || index.empty()) args.fail("--model, --adapter and --index are required");
  if (seconds <= 0 || warmup < 0 || rounds < 1) args.fail("--seconds must be > 0, --warmup >= 0, --rounds >= 1");

  const std::vector<std::string> texts = read_texts(queries);
  std::fprintf(stderr, "loading %s, %s, %s\n", model.c_str(), adapter.c_str(), index.c_str());
  const Engine engine{ClipModel::load(model), MoeAdapter::load(adapter), AnnIndex::load(index)};
  ServiceClient service(requests, results, k);
  service.wait_ready(60);

  // Per load, the figures of each round.
  struct Figures {
    std::vector<double> direct_qps, direct_p50, direct_p99, service_qps, service_p50, service_p99, pipeline_p50;
    std::vector<double> rate_ratio, p50_ratio, p99_p50;
    std::array<std::vector<double>, kStageCount> direct_stage_p50, service_stage_p50;
    std::vector<double> batch_rows_p50;
    int64_t errors = 0;
  };
  std::vector<Figures> figures(loads.size());
  for (int64_t round = 0; round < rounds; ++round) {
    for (size_t l = 0; l < loads.size(); ++l) {
      const Run direct = run_direct(engine, texts, loads[l], k, warmup, seconds);
      const Run served = service.run(texts, loads[l], warmup, seconds);
      Figures& f = figures[l];
      const double d50 = percentile(direct.latency_ms, 50), s50 = percentile(served.latency_ms, 50),
                   s99 = percentile(served.latency_ms, 99);
      f.direct_qps.push_back(direct.qps());
      f.direct_p50.push_back(d50);
      f.direct_p99.push_back(percentile(direct.latency_ms, 99));
      f.service_qps.push_back(served.qps());
      f.service_p50.push_back(s50);
      f.service_p99.push_back(s99);
      f.pipeline_p50.push_back(percentile(served.pipeline_ms, 50));
      f.rate_ratio.push_back(served.qps() / direct.qps());
      f.p50_ratio.push_back(s50 / d50);
      f.p99_p50.push_back(s99 / s50);
      f.errors += served.errors;
      for (size_t i = 0; i < kStageCount; ++i) {
        f.direct_stage_p50[i].push_back(percentile(direct.stage_ms[i], 50));
        f.service_stage_p50[i].push_back(percentile(served.stage_ms[i], 50));
      }
      f.batch_rows_p50.push_back(percentile(served.batch_rows, 50));
      std::fprintf(stderr,
                   "[round %lld, load %lld] direct %.0f q/s p50 %.3f ms, service %.0f q/s p50 %.3f ms p99 %.3f ms\n",
                   static_cast<long long>(round + 1), static_cast<long long>(loads[l]), direct.qps(), d50, served.qps(),
                   s50, s99);
    }
  }

  Table table({"load", "direct q/s", "direct p50 ms", "direct p99 ms", "service q/s", "service p50 ms",
               "service p99 ms", "pipeline p50 ms", "q/s vs direct", "p50 vs direct", "p99/p50", "errors"});
  Json out = report_header("moe-bench-service", false);
  out.set("model", model);
  out.set("adapter", adapter);
  out.set("index", index);
  out.set("rounds", rounds);
  out.set("seconds", seconds);
  out.set("warmup_s", warmup);
  Json& results_json = out.set("results", Json::array());
  for (size_t l = 0; l < loads.size(); ++l) {
    const Figures& f = figures[l];
    table.add({std::to_string(loads[l]), fmt(median_of(f.direct_qps)), fmt(median_of(f.direct_p50)),
               fmt(median_of(f.direct_p99)), fmt(median_of(f.service_qps)), fmt(median_of(f.service_p50)),
               fmt(median_of(f.service_p99)), fmt(median_of(f.pipeline_p50)), fmt_ratio(median_of(f.rate_ratio)),
               fmt_ratio(median_of(f.p50_ratio)), fmt(median_of(f.p99_p50)), std::to_string(f.errors)});
    Json j = Json::object();
    j.set("load", loads[l]);
    const auto series = [&j](const char* key, const std::vector<double>& v) {
      Json a = Json::array();
      for (double x : v) a.push(x);
      j.set(key, a);
    };
    series("direct_qps", f.direct_qps);
    series("direct_p50_ms", f.direct_p50);
    series("direct_p99_ms", f.direct_p99);
    series("service_qps", f.service_qps);
    series("service_p50_ms", f.service_p50);
    series("service_p99_ms", f.service_p99);
    series("pipeline_p50_ms", f.pipeline_p50);
    for (size_t i = 0; i < kStageCount; ++i) {
      series(("direct_" + std::string(kStages[i]) + "_p50_ms").c_str(), f.direct_stage_p50[i]);
      series(("service_" + std::string(kStages[i]) + "_p50_ms").c_str(), f.service_stage_p50[i]);
    }
    series("service_batch_rows_p50", f.batch_rows_p50);
    j.set("service_errors", f.errors);
    results_json.push(j);
  }
  std::printf("\n");
  table.print();
  std::printf(
      "\nload = queries in flight (service) = texts per call (direct); medians over %lld rounds of %g s. A direct "
      "query's latency is its call's; a service query's runs from its send to its answer, of which pipeline p50 is "
      "the time inside the pipeline (timings_ms.total). q/s vs direct, p50 vs direct and p99/p50: medians of the "
      "rounds' ratios.\n",
      static_cast<long long>(rounds), seconds);

  // Where the time goes: the service's stages against the same engine calls made directly.
  Table stages({"load", "side", "queue p50 ms", "encode p50 ms", "adapter p50 ms", "search p50 ms", "total p50 ms",
                "latency p50 ms", "batch rows p50"});
  for (size_t l = 0; l < loads.size(); ++l) {
    const Figures& f = figures[l];
    const auto row = [&](const char* side, const std::array<std::vector<double>, kStageCount>& p50, double total,
                         double latency, const std::string& rows) {
      std::vector<std::string> cells = {std::to_string(loads[l]), side};
      for (size_t i = 0; i < kStageCount; ++i) cells.push_back(fmt(median_of(p50[i])));
      cells.insert(cells.end(), {fmt(total), fmt(latency), rows});
      stages.add(cells);
    };
    row("direct", f.direct_stage_p50, median_of(f.direct_p50), median_of(f.direct_p50), std::to_string(loads[l]));
    row("service", f.service_stage_p50, median_of(f.pipeline_p50), median_of(f.service_p50),
        fmt(median_of(f.batch_rows_p50)));
  }
  std::printf("\n");
  stages.print();
  std::printf(
      "\nPer stage, p50 over the queries (direct: over the calls), median over the rounds; p50s do not add up. "
      "service: timings_ms (adapter = route + expert, total = timings_ms.total) and cost.batch_rows, the batch "
      "moe-encode formed; direct: ClipModel::encode_texts, MoeAdapter::apply and AnnIndex::search timed around each "
      "call. latency - total = the service's time outside the pipeline stages (ZeroMQ, JSON, zmq-query, "
      "zmq-publish, the client).\n");

  // The targets of issue 12: at 1 in flight >= 0.7x the direct rate and p50 <= 1.5x the direct
  // latency; >= 0.7x the direct rate at the largest load; p99 <= 3x p50.
  for (size_t l = 0; l < loads.size(); ++l) {
    const Figures& f = figures[l];
    std::string line = "load " + std::to_string(loads[l]) + ": service at " + fmt_ratio(median_of(f.rate_ratio)) +
                       " the direct rate (target >= 0.7x)";
    if (loads[l] == 1) line += ", p50 at " + fmt_ratio(median_of(f.p50_ratio)) + " the direct latency (target <= 1.5x)";
    line += ", p99 at " + fmt_ratio(median_of(f.p99_p50)) + " its p50 (target <= 3x)";
    std::printf("%s\n", line.c_str());
  }
  write_json(json_path, out);
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  return moe::bench::guarded_main([&] { return moe::bench::run(argc, argv); });
}
