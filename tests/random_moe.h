// Test helper: a Mixtral-style MoE layer with random weights of any size, written to a
// temporary safetensors file and loaded through the normal loader.
#pragma once

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "moe/moe_layer.h"
#include "moe/safetensors.h"
#include "moe/tensor.h"

namespace moe::test {

inline Tensor random_tensor(int64_t rows, int64_t cols, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  Tensor t = Tensor::zeros(DType::F32, {rows, cols});
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(rng);
  return t;
}

// Router gate [E, D], experts.e.w1/w3 [I, D], w2 [D, I]; weights ~ N(0, 1/sqrt(fan_in)).
inline MoeLayer random_moe_layer(int experts, int hidden, int inter, int top_k, unsigned seed) {
  struct Item {
    std::string name;
    int64_t rows, cols;
    std::vector<float> data;
  };
  std::mt19937 rng(seed);
  std::vector<Item> items;
  auto add = [&](const std::string& name, int64_t rows, int64_t cols) {
    std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(static_cast<float>(cols)));
    Item it{name, rows, cols, std::vector<float>(static_cast<size_t>(rows * cols))};
    for (float& v : it.data) v = nd(rng);
    items.push_back(std::move(it));
  };
  add("gate.weight", experts, hidden);
  for (int e = 0; e < experts; ++e) {
    const std::string p = "experts." + std::to_string(e) + ".";
    add(p + "w1.weight", inter, hidden);
    add(p + "w3.weight", inter, hidden);
    add(p + "w2.weight", hidden, inter);
  }
  std::string header = "{";
  uint64_t offset = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const uint64_t bytes = items[i].data.size() * sizeof(float);
    header += (i ? "," : "") + std::string("\"") + items[i].name + "\":{\"dtype\":\"F32\",\"shape\":[" +
              std::to_string(items[i].rows) + "," + std::to_string(items[i].cols) + "],\"data_offsets\":[" +
              std::to_string(offset) + "," + std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  header += "}";
  while (header.size() % 8) header += ' ';
  char path[] = "/tmp/gst-moe-test-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) throw std::runtime_error("mkstemp failed");
  close(fd);
  {
    std::ofstream f(path, std::ios::binary);
    const uint64_t n = header.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (const Item& it : items)
      f.write(reinterpret_cast<const char*>(it.data.data()),
              static_cast<std::streamsize>(it.data.size() * sizeof(float)));
  }
  MoeConfig cfg;
  cfg.hidden_size = hidden;
  cfg.num_experts = experts;
  cfg.top_k = top_k;
  cfg.intermediate_size = inter;
  cfg.routing = RoutingKind::Mixtral;
  cfg.norm_topk_prob = true;
  cfg.source = "random_moe_layer";
  MoeLayer layer = MoeLayer::load(cfg, Checkpoint::open(path), "");
  std::remove(path);  // the mapping stays valid
  return layer;
}

}  // namespace moe::test
