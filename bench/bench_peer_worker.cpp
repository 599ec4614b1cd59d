// moe-bench-peer-worker: the engine's side of tools/bench-peers.sh (docs/benchmarks.md, "CPU GEMM
// libraries and peers"). It loads one CLIP directory and then times encoder calls on request, so
// that a driver can interleave it, call by call, with PyTorch and ONNX Runtime workers that
// answer the same protocol. Not a benchmark by itself: the driver does the rounds and ratios.
//
//   moe-bench-peer-worker --write-model DIR   writes a synthetic CLIP ViT-B/32 (random weights,
//                                             bench/clip_writer.h, seed 42) to DIR and exits
//   moe-bench-peer-worker --model DIR [--threads N] [--precision P]  serves requests on stdin
//                                             (N: the CPU backend's intra-op threads,
//                                             ComputeOptions::threads; P: fp32 (default), bf16 or
//                                             fp16, ComputeOptions::precision), one per line:
//     load NAME images PATH B    raw f32 pixels [B, channels, image_size, image_size] from PATH
//     load NAME texts PATH B L   raw int32 token ids [B, L] from PATH
//     run NAME N                 N encode calls (encode_pixels / encode_token_ids: the towers
//                                alone, as moe-bench-encoder), answers "ok SECONDS" for all N
//     dump NAME PATH             one call; writes the embeddings (raw f32 [B, projection_dim])
//     info                       "ok" + the precision and the BLAS/oneDNN libraries this
//                                process has mapped
//     quit
//   Every answer is one line: "ok ..." or "error WHY".
//
// Threads: --threads sets the engine's (its GEMMs run on them); the driver also sets
// OPENBLAS_NUM_THREADS and OMP_NUM_THREADS for what still runs OpenBLAS.
#include <dlfcn.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
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
    "usage: moe-bench-peer-worker --write-model DIR | --model DIR [--threads N] [--precision fp32|bf16|fp16]\n"
    "  The engine's worker for tools/bench-peers.sh; requests on stdin (see the source's header).\n";

struct Input {
  bool images = false;
  Tensor pixels;
  std::vector<std::vector<int32_t>> ids;
};

template <typename T>
std::vector<T> read_raw(const std::string& path, size_t count) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error("cannot read " + path);
  std::vector<T> v(count);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(count * sizeof(T)));
  if (f.gcount() != static_cast<std::streamsize>(count * sizeof(T)))
    throw Error(path + ": expected " + std::to_string(count * sizeof(T)) + " bytes");
  return v;
}

std::string mapped_math_libs() {
  std::ifstream maps("/proc/self/maps");
  std::string line, out;
  while (std::getline(maps, line)) {
    const size_t slash = line.rfind('/');
    if (slash == std::string::npos) continue;
    const std::string file = line.substr(slash + 1);
    if (file.find("blas") == std::string::npos && file.find("blis") == std::string::npos &&
        file.find("dnnl") == std::string::npos && file.find("mkl") == std::string::npos)
      continue;
    if (out.find(file) == std::string::npos) out += (out.empty() ? "" : " ") + file;
  }
  if (out.empty()) out = "(none)";
  // OpenBLAS says which kernel family it runs (looked up by name: any other library may be linked).
  if (auto corename = reinterpret_cast<char* (*)()>(dlsym(RTLD_DEFAULT, "openblas_get_corename")))
    out += std::string(", OpenBLAS core ") + corename();
  return out;
}

int serve(const std::string& dir, int threads, kernels::WeightType precision) {
  ComputeOptions options;
  options.threads = threads;  // 0: the cores this process may use
  options.precision = precision;
  const ClipModel model = ClipModel::load(dir, options);
  const ClipConfig& cfg = model.config();
  std::map<std::string, Input> inputs;
  auto encode = [&](const Input& in) {
    return in.images ? model.encode_pixels(in.pixels) : model.encode_token_ids(in.ids);
  };
  std::printf("ready\n");
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream req(line);
    std::string cmd;
    req >> cmd;
    if (cmd.empty()) continue;
    if (cmd == "quit") break;
    try {
      if (cmd == "load") {
        std::string name, kind, path;
        int64_t b = 0, l = 0;
        req >> name >> kind >> path >> b;
        Input in;
        if (kind == "images") {
          const int64_t c = cfg.vision.num_channels, s = cfg.vision.image_size;
          in.images = true;
          in.pixels = Tensor::from_vector(read_raw<float>(path, static_cast<size_t>(b * c * s * s)), {b, c, s, s});
        } else if (kind == "texts") {
          req >> l;
          const std::vector<int32_t> flat = read_raw<int32_t>(path, static_cast<size_t>(b * l));
          for (int64_t i = 0; i < b; ++i) in.ids.emplace_back(flat.begin() + i * l, flat.begin() + (i + 1) * l);
        } else {
          throw Error("load: images or texts, not '" + kind + "'");
        }
        inputs[name] = std::move(in);
        std::printf("ok\n");
      } else if (cmd == "run" || cmd == "dump") {
        std::string name, arg;
        req >> name >> arg;
        auto it = inputs.find(name);
        if (it == inputs.end()) throw Error("no input '" + name + "'");
        if (cmd == "run") {
          const int64_t n = std::max<int64_t>(1, std::stoll(arg));
          const Clock::time_point t0 = Clock::now();
          for (int64_t i = 0; i < n; ++i) encode(it->second);
          std::printf("ok %.9g\n", seconds_since(t0));
        } else {
          const ClipEncodeResult r = encode(it->second);
          std::ofstream f(arg, std::ios::binary);
          f.write(reinterpret_cast<const char*>(r.embeds.data<float>()),
                  static_cast<std::streamsize>(r.embeds.numel() * 4));
          if (!f) throw Error("cannot write " + arg);
          std::printf("ok %lld %lld\n", static_cast<long long>(r.embeds.shape()[0]),
                      static_cast<long long>(r.embeds.shape()[1]));
        }
      } else if (cmd == "info") {
        std::printf("ok %s weights, %s\n", kernels::weight_type_name(precision), mapped_math_libs().c_str());
      } else {
        throw Error("unknown request '" + cmd + "'");
      }
    } catch (const std::exception& e) {
      std::string why = e.what();
      for (char& ch : why)
        if (ch == '\n') ch = ' ';
      std::printf("error %s\n", why.c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}

int run(int argc, char** argv) {
  Args args(argc, argv, kUsage);
  const std::string write_dir = args.str("write-model", "");
  const std::string model_dir = args.str("model", "");
  const int threads = std::stoi(args.str("threads", "0"));
  const kernels::WeightType precision = parse_precision(args.str("precision", "fp32"));
  args.finish();
  if (!write_dir.empty()) {
    std::filesystem::create_directories(write_dir);
    write_random_clip(write_dir, ClipShape::vit_b32(), 42);
    return 0;
  }
  if (model_dir.empty()) args.fail("--write-model DIR or --model DIR");
  return serve(model_dir, threads, precision);
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  return moe::bench::guarded_main([&] { return moe::bench::run(argc, argv); });
}
