// moe-bench-memory: memory of the loaded models per device and weight precision, against f32 on
// the same device measured in the same run.
//
// Each measurement runs in a fresh process of its own (this program again, with --child), so that
// nothing one load leaves in the allocator or the address space counts for the next, and so that
// CUDA, which the parent initialised to list the devices and which does not survive a fork, starts
// clean: the child loads the CLIP model and the MoE adapter with the device and precision, encodes
// one batch of images and one of texts and runs the adapter on them (so every weight page is
// touched and the working buffers exist), then reports its peak resident set (VmHWM, host memory
// including mmap-ed checkpoint pages it read) above the resident set it started with, the
// anonymous memory it holds at the end (RssAnon: what it allocated, such as converted and packed
// weights, without the checkpoint's file pages) and, on a GPU, the device memory taken since it
// started (total - free, before and after). Models: the synthetic ViT-B/32 of moe-bench-encoder
// and a synthetic adapter for it (512 wide, 8 experts of width 2048, top-2), f32 safetensors
// written once to a temporary directory; --quick the tiny test fixtures.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "bench_common.h"
#include "clip_writer.h"
#include "moe/clip_model.h"
#include "moe/compute.h"
#include "moe/moe_layer.h"

namespace moe::bench {
namespace {

const char* kUsage =
    "usage: moe-bench-memory [options]\n"
    "  Peak host memory (VmHWM) and device memory of CLIP + MoE adapter per device and precision;\n"
    "  baseline = f32 on the same device, measured in the same run (each load in its own process).\n"
    "  --quick            tests/fixtures/clip_tiny_bpe + adapter_tiny instead of ViT-B/32 + a synthetic adapter\n"
    "  --device LIST      auto (cpu, + cuda:0 when present) | cpu | cuda:N, comma-separated\n"
    "  --precisions LIST  f32,f16,bf16 (default); the first is the baseline\n"
    "  --batch N          images and texts encoded once (default 8)\n"
    "  --json FILE        also write the results as JSON\n";

struct Usage {
  double host_peak_mib = 0;  // the child's peak resident set above what it started with
  double host_anon_mib = 0;  // its anonymous resident memory above what it started with, at the end
  double device_mib = 0;     // device memory taken (0 on the CPU)
};

double status_kib(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string k;
  double v = 0;
  std::string unit;
  while (f >> k) {
    if (k == key) {
      f >> v >> unit;
      return v;
    }
    std::getline(f, unit);
  }
  return 0;
}

// Loads, runs once, measures; in the child process.
Usage measure(const std::string& clip_dir, const std::string& adapter_dir, const std::string& device,
              const std::string& precision, int64_t batch) {
  const double start_kib = status_kib("VmRSS:");  // the pages shared with the parent at fork
  const double start_anon_kib = status_kib("RssAnon:");
  std::shared_ptr<kernels::Backend> backend = device == "cpu" ? nullptr : open_backend(device);
  const kernels::MemoryInfo before = backend ? backend->memory_info() : kernels::MemoryInfo{};
  ComputeOptions options;
  options.device = device;
  options.precision = parse_precision(precision);
  const ClipModel clip = ClipModel::load(clip_dir, options);
  const MoeAdapter adapter = MoeAdapter::load(adapter_dir, options);
  const ClipConfig& cfg = clip.config();
  Tensor pixels =
      Tensor::zeros(DType::F32, {batch, cfg.vision.num_channels, cfg.vision.image_size, cfg.vision.image_size});
  fill_uniform(pixels.data<float>(), static_cast<size_t>(pixels.numel()), 2.0f, 5);
  const int64_t L = std::min<int64_t>(16, cfg.text.max_position_embeddings);
  std::vector<std::vector<int32_t>> ids(static_cast<size_t>(batch), std::vector<int32_t>(static_cast<size_t>(L), 320));
  for (auto& seq : ids) {
    seq.front() = cfg.text.bos_token_id;
    seq.back() = cfg.text.eos_token_id;
  }
  adapter.apply(clip.encode_pixels(pixels).embeds);
  adapter.apply(clip.encode_token_ids(ids).embeds);
  Usage u;
  u.host_peak_mib = (status_kib("VmHWM:") - start_kib) / 1024.0;
  u.host_anon_mib = (status_kib("RssAnon:") - start_anon_kib) / 1024.0;
  if (backend) {
    const kernels::MemoryInfo after = backend->memory_info();
    u.device_mib =
        static_cast<double>(before.free_bytes - std::min(before.free_bytes, after.free_bytes)) / (1024.0 * 1024.0);
  }
  return u;
}

// The child's side: measure() and its result on stdout ("ok HOST DEVICE" or "error WHY").
int child_main(const std::string& clip_dir, const std::string& adapter_dir, const std::string& device,
               const std::string& precision, int64_t batch) {
  try {
    const Usage u = measure(clip_dir, adapter_dir, device, precision, batch);
    std::printf("ok %f %f %f\n", u.host_peak_mib, u.host_anon_mib, u.device_mib);
  } catch (const std::exception& e) {
    std::printf("error %s\n", e.what());
  }
  return 0;
}

// measure() in a fresh process (this program with --child); throws with its message when it failed.
Usage measure_in_child(const std::string& clip_dir, const std::string& adapter_dir, const std::string& device,
                       const std::string& precision, int64_t batch) {
  int fds[2];
  if (pipe(fds) != 0) throw Error("pipe failed");
  const std::string batch_arg = std::to_string(batch);
  const char* argv[] = {"/proc/self/exe", "--child",         clip_dir.c_str(),  adapter_dir.c_str(),
                        device.c_str(),   precision.c_str(), batch_arg.c_str(), nullptr};
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) throw Error("fork failed");
  if (pid == 0) {  // only async-signal-safe calls until exec
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    execv(argv[0], const_cast<char* const*>(argv));
    _exit(127);
  }
  close(fds[1]);
  std::string text;
  char buf[512];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  while (!text.empty() && text.back() == '\n') text.pop_back();
  if (text.rfind("ok ", 0) != 0)
    throw Error(device + " " + precision + ": " +
                (text.rfind("error ", 0) == 0
                     ? text.substr(6)
                     : "the measuring process failed (status " + std::to_string(status) + ")"));
  Usage u;
  std::sscanf(text.c_str() + 3, "%lf %lf %lf", &u.host_peak_mib, &u.host_anon_mib, &u.device_mib);
  return u;
}

struct Row {
  std::string device, precision;
  Usage u;
};

int run(int argc, char** argv) {
  if (argc == 7 && std::string(argv[1]) == "--child")
    return child_main(argv[2], argv[3], argv[4], argv[5], std::atoll(argv[6]));
  Args args(argc, argv, kUsage);
  const bool quick = args.flag("quick");
  const std::vector<std::string> devices = resolve_devices(args.str("device", "auto"));
  const std::vector<std::string> precisions = args.str_list("precisions", "f32,f16,bf16");
  const int64_t batch = args.integer("batch", 8);
  const std::string json_path = args.str("json", "");
  args.finish();
  if (precisions.empty() || batch < 1) args.fail("--precisions: at least one; --batch >= 1");

  std::string clip_dir, adapter_dir, model_name, temp;
  if (quick) {
    clip_dir = std::string(MOE_SOURCE_DIR) + "/tests/fixtures/clip_tiny_bpe";
    adapter_dir = std::string(MOE_SOURCE_DIR) + "/tests/fixtures/adapter_tiny";
    model_name = "tests/fixtures/clip_tiny_bpe + adapter_tiny (tiny: figures say little about real models)";
  } else {
    char tmpl[] = "/tmp/moe-bench-memory-XXXXXX";
    if (!mkdtemp(tmpl)) throw Error("mkdtemp failed");
    temp = tmpl;
    clip_dir = temp + "/clip";
    adapter_dir = temp + "/adapter";
    std::filesystem::create_directories(clip_dir);
    std::filesystem::create_directories(adapter_dir);
    const ClipShape shape = ClipShape::vit_b32();
    write_random_clip(clip_dir, shape, 42);
    write_random_adapter(adapter_dir, shape.projection_dim, 8, 2, 2048, 43);
    model_name = "synthetic CLIP ViT-B/32 + adapter (512 wide, 8 experts x 2048, top-2), f32 safetensors";
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    }
  } cleanup{temp};

  std::printf("# moe-bench-memory\n\nmodel: %s; %lld images + %lld texts encoded once; one process per row\n",
              model_name.c_str(), static_cast<long long>(batch), static_cast<long long>(batch));
  std::vector<Row> rows;
  std::vector<std::pair<std::string, std::string>> skipped;
  for (const std::string& device : devices)
    for (const std::string& precision : precisions) {
      try {
        rows.push_back({device, precision, measure_in_child(clip_dir, adapter_dir, device, precision, batch)});
        std::fprintf(stderr, "[%s %s] host peak %.1f MiB, anonymous %.1f MiB, device %.1f MiB\n", device.c_str(),
                     precision.c_str(), rows.back().u.host_peak_mib, rows.back().u.host_anon_mib,
                     rows.back().u.device_mib);
      } catch (const std::exception& e) {
        skipped.emplace_back(device + " " + precision, e.what());
      }
    }

  Table table({"device", "weights", "host peak MiB", "vs " + precisions.front(), "host anonymous MiB",
               "vs " + precisions.front(), "device MiB", "vs " + precisions.front()});
  Json out = report_header("moe-bench-memory", quick);
  out.set("model", model_name);
  out.set("batch", batch);
  out.set("baseline", precisions.front() + " on the same device, in the same run");
  Json& results = out.set("results", Json::array());
  for (const Row& r : rows) {
    const Row* base = nullptr;
    for (const Row& q : rows)
      if (q.device == r.device && q.precision == precisions.front()) base = &q;
    auto ratio = [](double v, double b) { return b > 0 ? fmt_ratio(v / b) : std::string("-"); };
    table.add({r.device, r.precision, fmt(r.u.host_peak_mib),
               base ? ratio(r.u.host_peak_mib, base->u.host_peak_mib) : "-", fmt(r.u.host_anon_mib),
               base ? ratio(r.u.host_anon_mib, base->u.host_anon_mib) : "-",
               r.device == "cpu" ? "-" : fmt(r.u.device_mib),
               r.device == "cpu" || !base ? "-" : ratio(r.u.device_mib, base->u.device_mib)});
    Json j = Json::object();
    j.set("device", r.device);
    j.set("precision", r.precision);
    j.set("host_peak_mib", r.u.host_peak_mib);
    j.set("host_anon_mib", r.u.host_anon_mib);
    j.set("device_mib", r.u.device_mib);
    results.push(j);
  }
  std::printf("\n");
  table.print();
  std::printf(
      "\nhost peak = peak resident set (VmHWM) of the process that loaded and ran the models, above what it "
      "started with (includes the checkpoint pages it read); host anonymous = its anonymous resident memory "
      "(RssAnon) after the calls, above what it started with: what it allocated (converted and packed weights, "
      "buffers), not the checkpoint's file pages; device = device memory taken (total - free) by that process.\n");
  for (const auto& s : skipped) std::printf("skipped %s: %s\n", s.first.c_str(), s.second.c_str());
  write_json(json_path, out);
  return skipped.empty() ? 0 : 1;  // a row asked for and not measured is a failure
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  return moe::bench::guarded_main([&] { return moe::bench::run(argc, argv); });
}
