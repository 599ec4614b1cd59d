// moe-bench-encoder: CLIP encoder throughput (images/s, texts/s) per batch size, against batch 1
// measured in the same run.
//
// Model: a synthetic CLIP ViT-B/32 (openai/clip-vit-base-patch32's shapes, random weights)
// written to a temporary directory with transformers' tensor names and loaded through
// ClipModel::load like a real checkpoint; --quick uses tests/fixtures/clip_tiny_bpe instead;
// --model DIR benchmarks any CLIP directory. Images are timed from preprocessed pixels
// (encode_pixels: the vision tower alone), texts from token ids of a fixed length
// (encode_token_ids: the text tower alone), so tokenizer and image decoding stay out.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "bench_common.h"
#include "clip_writer.h"
#include "moe/clip_model.h"
#include "moe/compute.h"
#include "moe/error.h"

namespace moe::bench {
namespace {

const char* kUsage =
    "usage: moe-bench-encoder [options]\n"
    "  CLIP encoder images/s and texts/s per batch size; baseline = batch 1 in the same run.\n"
    "  --quick            tests/fixtures/clip_tiny_bpe instead of a synthetic ViT-B/32 (smoke run)\n"
    "  --model DIR        a CLIP model directory to benchmark instead (config.json + safetensors)\n"
    "  --device LIST      cpu (default), cuda:N, auto; comma-separated for several\n"
    "  --precision P      f32 (default), f16 or bf16 (weights; f32 accumulation)\n"
    "  --batches LIST     batch sizes (default 1,2,4,8,16,32,64)\n"
    "  --modality LIST    images,texts (default both)\n"
    "  --text-tokens N    tokens per text incl. start and end (default 16)\n"
    "  --warmup N --reps N timing (default 1 and 5; ViT-B/32 on CPU: 1 and 3); median reported\n"
    "  --keep-model DIR   write the synthetic model to DIR and keep it (default: a temp dir, removed)\n"
    "  --json FILE        also write the results as JSON\n";

// The one place where the encoder's device and precision are chosen: a device that cannot be
// used (no GPU, built without CUDA) is reported with the reason and skipped by the caller.
std::optional<ClipModel> select_encoder(const std::string& dir, const std::string& device, const std::string& precision,
                                        std::string* why) {
  try {
    moe::ComputeOptions options;
    options.device = device;
    options.precision = moe::parse_precision(precision);
    return ClipModel::load(dir, options);
  } catch (const moe::Error& e) {
    *why = e.what();
    return std::nullopt;
  }
}

// A temporary directory removed on scope exit (unless kept).
struct ModelDir {
  std::string path;
  bool remove = false;
  ~ModelDir() {
    if (remove && !path.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  }
};

struct Row {
  std::string device, modality;
  int64_t batch;
  Sample s;
};

int run(int argc, char** argv) {
  Args args(argc, argv, kUsage);
  const bool quick = args.flag("quick");
  const std::string model_arg = args.str("model", "");
  const std::vector<std::string> devices = args.str_list("device", "cpu");
  const std::string precision = args.str("precision", "f32");
  const std::vector<int64_t> batches = args.int_list("batches", {1, 2, 4, 8, 16, 32, 64});
  const std::vector<std::string> modalities = args.str_list("modality", "images,texts");
  const int64_t text_tokens = args.integer("text-tokens", 16);
  const bool synthetic = model_arg.empty() && !quick;
  TimingOptions t;
  t.warmup = static_cast<int>(args.integer("warmup", 1));
  t.reps = static_cast<int>(args.integer("reps", synthetic ? 3 : 5));
  t.min_sample_s = 0.02;
  const std::string keep = args.str("keep-model", "");
  const std::string json_path = args.str("json", "");
  args.finish();
  for (const std::string& m : modalities)
    if (m != "images" && m != "texts") args.fail("--modality: images and/or texts, not '" + m + "'");
  if (text_tokens < 2) args.fail("--text-tokens: at least 2 (start and end)");

  ModelDir dir;
  std::string model_name;
  if (!model_arg.empty()) {
    dir.path = model_arg;
    model_name = model_arg;
  } else if (quick) {
    dir.path = std::string(MOE_SOURCE_DIR) + "/tests/fixtures/clip_tiny_bpe";
    model_name = "tests/fixtures/clip_tiny_bpe (tiny: figures say little about real models)";
  } else {
    if (!keep.empty()) {
      std::filesystem::create_directories(keep);
      dir.path = keep;
    } else {
      char tmpl[] = "/tmp/moe-bench-clip-XXXXXX";
      if (!mkdtemp(tmpl)) throw Error("mkdtemp failed");
      dir.path = tmpl;
      dir.remove = true;
    }
    const Clock::time_point t0 = Clock::now();
    write_random_clip(dir.path, ClipShape::vit_b32(), 42);
    std::fprintf(stderr, "wrote a synthetic CLIP ViT-B/32 (random weights) to %s in %.1f s\n", dir.path.c_str(),
                 seconds_since(t0));
    model_name = "synthetic CLIP ViT-B/32 (random weights)";
  }

  std::printf("# moe-bench-encoder\n\nmodel: %s\n", model_name.c_str());
  std::vector<Row> rows;
  std::vector<std::pair<std::string, std::string>> skipped;
  for (const std::string& device : devices) {
    std::string why;
    std::optional<ClipModel> model = select_encoder(dir.path, device, precision, &why);
    if (!model) {
      skipped.emplace_back(device, why);
      continue;
    }
    const ClipConfig& cfg = model->config();
    const int64_t L = std::min<int64_t>(text_tokens, cfg.text.max_position_embeddings);
    const int64_t S = cfg.vision.image_size, C = cfg.vision.num_channels;
    std::printf(
        "vision: hidden %d, %d layers, %lldx%lld px, patch %d; text: hidden %d, %d layers, %lld tokens/text; "
        "%s, %s; %d warm-up + median of %d\n",
        cfg.vision.hidden_size, cfg.vision.num_hidden_layers, static_cast<long long>(S), static_cast<long long>(S),
        cfg.vision.patch_size, cfg.text.hidden_size, cfg.text.num_hidden_layers, static_cast<long long>(L),
        device.c_str(), precision.c_str(), t.warmup, t.reps);
    for (const std::string& modality : modalities) {
      for (int64_t B : batches) {
        std::function<void()> call;
        Tensor pixels;
        std::vector<std::vector<int32_t>> ids;
        if (modality == "images") {
          pixels = Tensor::zeros(DType::F32, {B, C, S, S});
          fill_uniform(pixels.data<float>(), static_cast<size_t>(pixels.numel()), 2.0f, 11 + static_cast<uint64_t>(B));
          call = [&] { model->encode_pixels(pixels); };
        } else {
          Rng rng(13 + static_cast<uint64_t>(B));
          const int32_t bos = cfg.text.bos_token_id, eos = cfg.text.eos_token_id;
          const int64_t vocab_plain = std::min<int64_t>(cfg.text.vocab_size, std::min(bos, eos));
          ids.assign(static_cast<size_t>(B), std::vector<int32_t>(static_cast<size_t>(L)));
          for (auto& seq : ids) {
            for (int32_t& id : seq) id = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(vocab_plain));
            seq.front() = bos;
            seq.back() = eos;
          }
          call = [&] { model->encode_token_ids(ids); };
        }
        Row r{device, modality, B, time_calls(call, nullptr, t)};
        std::fprintf(stderr, "[%s %s] batch %lld: %.3f ms\n", device.c_str(), modality.c_str(),
                     static_cast<long long>(B), r.s.median * 1e3);
        rows.push_back(r);
      }
    }
  }

  Table table(
      {"device", "input", "batch", "items/s", "ms/batch", "vs batch " + std::to_string(batches.front()), "spread"});
  Json out = report_header("moe-bench-encoder", quick);
  out.set("model", model_name);
  out.set("precision", precision);
  out.set("text_tokens", text_tokens);
  out.set("baseline", "items/s at the first batch size (" + std::to_string(batches.front()) + ") in the same run");
  Json& results = out.set("results", Json::array());
  for (const Row& r : rows) {
    double base = 0;
    for (const Row& q : rows)
      if (q.device == r.device && q.modality == r.modality && q.batch == batches.front())
        base = static_cast<double>(q.batch) / q.s.median;
    const double ips = static_cast<double>(r.batch) / r.s.median;
    table.add({r.device, r.modality, std::to_string(r.batch), fmt(ips), fmt(r.s.median * 1e3), fmt_ratio(ips / base),
               fmt_pct(r.s.spread())});
    Json j = Json::object();
    j.set("device", r.device);
    j.set("input", r.modality);
    j.set("batch", r.batch);
    j.set("items_per_s", ips);
    j.set("ratio_vs_first_batch", ips / base);
    j.set("timing", sample_json(r.s));
    results.push(j);
  }
  Json& sk = out.set("skipped", Json::array());
  std::printf("\n");
  table.print();
  std::printf("\nitems/s = batch ÷ median time of one encode call; vs batch %lld = items/s ÷ items/s at batch %lld.\n",
              static_cast<long long>(batches.front()), static_cast<long long>(batches.front()));
  for (const auto& s : skipped) {
    std::printf("skipped %s: %s\n", s.first.c_str(), s.second.c_str());
    Json j = Json::object();
    j.set("device", s.first);
    j.set("why", s.second);
    sk.push(j);
  }
  write_json(json_path, out);
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  return moe::bench::guarded_main([&] { return moe::bench::run(argc, argv); });
}
