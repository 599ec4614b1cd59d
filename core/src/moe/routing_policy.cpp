#include "moe/routing_policy.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "moe/error.h"

namespace moe {

bool RoutingPolicy::is_plain_top_k() const {
  return selection == ExpertSelection::TopK && temperature == 1.0 && capacity_factor == 0.0 &&
         balance == LoadBalance::None && explore == 0.0;
}

int RoutingPolicy::slots() const { return selection == ExpertSelection::TopK ? top_k : max_k; }

void RoutingPolicy::validate(int num_experts) const {
  const auto fail = [](const std::string& what) { throw Error("routing policy: " + what); };
  const std::string E = std::to_string(num_experts);
  if (selection == ExpertSelection::TopK && (top_k < 1 || top_k > num_experts))
    fail("top-k " + std::to_string(top_k) + " outside [1, " + E + "] (the adapter's experts)");
  if (selection == ExpertSelection::TopP) {
    if (!(top_p > 0.0 && top_p <= 1.0)) fail("top-p " + std::to_string(top_p) + " outside (0, 1]");
    if (min_k < 1 || max_k < min_k || max_k > num_experts)
      fail("min-k " + std::to_string(min_k) + " and max-k " + std::to_string(max_k) +
           " must satisfy 1 <= min-k <= " + "max-k <= " + E + " (the adapter's experts)");
  }
  if (!(temperature > 0.0) || !std::isfinite(temperature))
    fail("temperature " + std::to_string(temperature) + " must be > 0");
  if (!(capacity_factor >= 0.0) || !std::isfinite(capacity_factor))
    fail("capacity-factor " + std::to_string(capacity_factor) + " must be >= 0 (0: no limit)");
  if (!(balance_margin >= 0.0 && balance_margin <= 1.0))
    fail("balance-margin " + std::to_string(balance_margin) + " outside [0, 1]");
  if (!(balance_rate >= 0.0) || !std::isfinite(balance_rate))
    fail("balance-rate " + std::to_string(balance_rate) + " must be >= 0");
  if (!(explore >= 0.0 && explore <= 1.0)) fail("explore " + std::to_string(explore) + " outside [0, 1]");
}

double ExpertLoad::coefficient_of_variation() const {
  if (slots.empty()) return 0.0;
  const double n = static_cast<double>(slots.size());
  const double mean = std::accumulate(slots.begin(), slots.end(), 0.0) / n;
  if (mean == 0.0) return 0.0;
  double var = 0.0;
  for (int64_t s : slots) var += (static_cast<double>(s) - mean) * (static_cast<double>(s) - mean);
  return std::sqrt(var / n) / mean;
}

Router::Router(int num_experts, const RoutingPolicy& policy) : experts_(num_experts), policy_(policy) {
  if (num_experts < 1) throw Error("routing policy: no experts");
  policy_.validate(num_experts);
  reset();
}

void Router::reset() {
  bias_.assign(static_cast<size_t>(experts_), 0.0f);
  load_ = ExpertLoad{};
  for (auto* v : {&load_.slots, &load_.peak, &load_.overflowed, &load_.explored}) v->assign(bias_.size(), 0);
  rng_.seed(policy_.seed);
}

namespace {

// softmax(logits / T) in f32, the max subtracted first; a row of -inf is routed as equal logits,
// as the backends' topk_softmax does.
void probabilities(const float* logits, int experts, double temperature, float* probs) {
  const float inv_t = static_cast<float>(1.0 / temperature);
  float top = -INFINITY;
  for (int e = 0; e < experts; ++e) top = std::max(top, logits[e] * inv_t);
  float sum = 0.0f;
  for (int e = 0; e < experts; ++e) {
    probs[e] = top == -INFINITY ? 1.0f : std::exp(logits[e] * inv_t - top);
    sum += probs[e];
  }
  for (int e = 0; e < experts; ++e) probs[e] /= sum;
}

// Whether the row may use each expert: a finite logit (or +inf); -inf marks an expert it may not
// use (MoeLayer's masked joint experts), unless the whole row is -inf (routed as equal logits).
void eligible_experts(const float* logits, int experts, char* eligible) {
  const bool all_masked = std::all_of(logits, logits + experts, [](float l) { return l == -INFINITY; });
  for (int e = 0; e < experts; ++e) eligible[e] = all_masked || logits[e] != -INFINITY;
}

struct Slot {
  int64_t row;
  int rank;  // 0: the row's first choice
  int32_t expert;
};

}  // namespace

Routing Router::route(const float* logits, int64_t rows) {
  const int E = experts_;
  const RoutingPolicy& p = policy_;
  const int slots = p.slots();
  const size_t ue = static_cast<size_t>(E);

  std::vector<float> probs(static_cast<size_t>(rows) * ue);
  // Per row: experts in selection order (biased probability, descending; ties to the lower id).
  std::vector<int32_t> order(probs.size());
  std::vector<std::vector<int32_t>> chosen(static_cast<size_t>(rows));
  std::vector<float> score(ue);
  std::vector<char> candidate(ue);
  // Ineligible experts (-inf logits) get probability 0 and are never selected, explored or
  // rerouted to. Experts no row of the batch may use are left out of the capacity and of the
  // balancing, so a batch routes exactly as it would among the eligible experts alone.
  std::vector<char> eligible(probs.size());
  std::vector<char> in_batch(ue, 0);
  for (int64_t r = 0; r < rows; ++r) {
    float* pr = probs.data() + r * E;
    probabilities(logits + r * E, E, p.temperature, pr);
    char* el = eligible.data() + r * E;
    eligible_experts(logits + r * E, E, el);
    for (size_t e = 0; e < ue; ++e) in_batch[e] |= el[e];
    const int usable = static_cast<int>(std::count(el, el + E, 1));
    // The bias only reorders the experts within balance_margin of the row's k-th most probable
    // (k = top_k, or min_k for top-p): it never steers a row to an expert the router rates far
    // lower (which is what costs recall).
    float threshold = -INFINITY;
    if (p.balance == LoadBalance::Bias && p.balance_margin < 1.0) {
      std::vector<float> sorted(pr, pr + E);
      const auto kth = static_cast<size_t>(std::min(p.selection == ExpertSelection::TopK ? p.top_k : p.min_k, E) - 1);
      std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(kth), sorted.end(),
                       std::greater<float>());
      threshold = sorted[kth] - static_cast<float>(p.balance_margin);
    }
    for (size_t e = 0; e < ue; ++e) {
      candidate[e] = el[e] && pr[e] >= threshold;
      score[e] = candidate[e] ? pr[e] + bias_[e] : pr[e];
    }
    int32_t* o = order.data() + r * E;
    std::iota(o, o + E, 0);
    // Candidates, then the other eligible experts, then the ineligible ones.
    std::stable_sort(o, o + E, [&](int32_t a, int32_t b) {
      if (el[a] != el[b]) return el[a] > el[b];
      return candidate[a] != candidate[b] ? candidate[a] > candidate[b] : score[a] > score[b];
    });
    int k = p.top_k;
    if (p.selection == ExpertSelection::TopP) {
      // The smallest prefix whose (unbiased) probability reaches p.
      float mass = 0.0f;
      k = 0;
      while (k < usable && mass < static_cast<float>(p.top_p)) mass += pr[o[k++]];
      k = std::clamp(k, p.min_k, p.max_k);
    }
    chosen[static_cast<size_t>(r)].assign(o, o + std::min(k, usable));
  }

  // Exploration: the row's last slot to the least-used expert it does not already use.
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::vector<int64_t> explored_to(static_cast<size_t>(rows), -1);
  if (p.explore > 0.0) {
    std::vector<int64_t> usage = load_.slots;  // this batch's picks count too
    for (int64_t r = 0; r < rows; ++r) {
      if (coin(rng_) >= p.explore) continue;
      auto& c = chosen[static_cast<size_t>(r)];
      const bool adds = c.size() == 1;  // never take a row's only choice: add a slot instead
      if (adds && slots < 2) continue;
      int32_t pick = -1;
      const char* el = eligible.data() + r * E;
      for (int32_t e = 0; e < E; ++e) {
        if (!el[e] || std::find(c.begin(), c.end(), e) != c.end()) continue;
        if (pick < 0 || usage[static_cast<size_t>(e)] < usage[static_cast<size_t>(pick)]) pick = e;
      }
      if (pick < 0) continue;
      if (adds)
        c.push_back(pick);
      else
        c.back() = pick;
      ++usage[static_cast<size_t>(pick)];
      explored_to[static_cast<size_t>(r)] = pick;
    }
  }

  // Capacity: place slots by priority, reroute or drop what finds its expert full.
  int64_t total = 0;
  for (const auto& c : chosen) total += static_cast<int64_t>(c.size());
  std::vector<int64_t> taken(ue, 0);
  std::vector<std::vector<int32_t>> kept(static_cast<size_t>(rows));
  const auto experts_in_batch = static_cast<int>(std::count(in_batch.begin(), in_batch.end(), 1));
  if (p.capacity_factor > 0.0 && rows > 0) {
    const auto capacity = static_cast<int64_t>(
        std::ceil(p.capacity_factor * static_cast<double>(total) / static_cast<double>(experts_in_batch)));
    std::vector<Slot> queue;
    queue.reserve(static_cast<size_t>(total));
    for (int64_t r = 0; r < rows; ++r) {
      const auto& c = chosen[static_cast<size_t>(r)];
      for (size_t j = 0; j < c.size(); ++j) queue.push_back({r, static_cast<int>(j), c[j]});
    }
    std::stable_sort(queue.begin(), queue.end(), [&](const Slot& a, const Slot& b) {
      if (a.rank != b.rank) return a.rank < b.rank;
      return probs[static_cast<size_t>(a.row * E + a.expert)] > probs[static_cast<size_t>(b.row * E + b.expert)];
    });
    for (const Slot& s : queue) {
      auto& k = kept[static_cast<size_t>(s.row)];
      int32_t e = s.expert;
      if (taken[static_cast<size_t>(e)] >= capacity) {
        ++load_.overflowed[static_cast<size_t>(e)];
        e = -1;
        if (p.overflow == CapacityOverflow::Reroute) {
          // The row's next most probable expert (true probability) with room that it does not use.
          const float* pr = probs.data() + s.row * E;
          const char* el = eligible.data() + s.row * E;
          const auto& c = chosen[static_cast<size_t>(s.row)];
          for (int32_t cand = 0; cand < E; ++cand) {
            const size_t uc = static_cast<size_t>(cand);
            if (!el[uc] || taken[uc] >= capacity || std::find(c.begin(), c.end(), cand) != c.end() ||
                std::find(k.begin(), k.end(), cand) != k.end())
              continue;
            if (e < 0 || pr[cand] > pr[e]) e = cand;
          }
        }
        if (e < 0) {
          ++load_.dropped;
          continue;
        }
      }
      ++taken[static_cast<size_t>(e)];
      k.push_back(e);
    }
  } else {
    kept = chosen;
    for (const auto& k : kept)
      for (int32_t e : k) ++taken[static_cast<size_t>(e)];
  }

  Routing out;
  out.rows = rows;
  out.top_k = slots;
  out.expert_ids.assign(static_cast<size_t>(rows * slots), Routing::kUnusedSlot);
  out.weights.assign(out.expert_ids.size(), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    auto& k = kept[static_cast<size_t>(r)];
    const float* pr = probs.data() + r * E;
    std::stable_sort(k.begin(), k.end(), [&](int32_t a, int32_t b) { return pr[a] > pr[b]; });
    float sum = 0.0f;
    for (int32_t e : k) sum += pr[e];
    for (size_t j = 0; j < k.size(); ++j) {
      out.expert_ids[static_cast<size_t>(r * slots) + j] = k[j];
      out.weights[static_cast<size_t>(r * slots) + j] = p.renormalize ? pr[k[j]] / sum : pr[k[j]];
    }
    const int64_t x = explored_to[static_cast<size_t>(r)];
    if (x >= 0 && std::find(k.begin(), k.end(), static_cast<int32_t>(x)) != k.end())
      ++load_.explored[static_cast<size_t>(x)];
  }

  // Balancing: move every expert's bias one step towards the batch's mean load.
  if (p.balance == LoadBalance::Bias && rows > 0) {
    const double mean = static_cast<double>(std::accumulate(taken.begin(), taken.end(), int64_t{0})) / experts_in_batch;
    const auto step = static_cast<float>(p.balance_rate);
    for (size_t e = 0; e < ue; ++e) {
      if (!in_batch[e]) continue;
      const auto t = static_cast<double>(taken[e]);
      if (t > mean) bias_[e] -= step;
      if (t < mean) bias_[e] += step;
    }
  }
  for (size_t e = 0; e < ue; ++e) {
    load_.slots[e] += taken[e];
    load_.peak[e] = std::max(load_.peak[e], taken[e]);
  }
  load_.rows += rows;
  ++load_.batches;
  return out;
}

void Router::count(const Routing& routing) {
  std::vector<int64_t> taken(static_cast<size_t>(experts_), 0);
  for (int32_t e : routing.expert_ids)
    if (e >= 0 && e < experts_) ++taken[static_cast<size_t>(e)];
  for (size_t e = 0; e < taken.size(); ++e) {
    load_.slots[e] += taken[e];
    load_.peak[e] = std::max(load_.peak[e], taken[e]);
  }
  load_.rows += routing.rows;
  ++load_.batches;
}

ExpertLoadMeter::ExpertLoadMeter(int num_experts, double tau_seconds)
    : tau_(tau_seconds),
      rate_(static_cast<size_t>(num_experts), 0.0),
      total_(static_cast<size_t>(num_experts), 0),
      peak_(static_cast<size_t>(num_experts), 0) {
  if (num_experts < 1 || !(tau_seconds > 0.0)) throw Error("expert load meter: needs experts and a time constant > 0");
}

void ExpertLoadMeter::add(const Routing& routing, double now) {
  // rate = Σ slots_i · exp(-(now - t_i) / tau) / tau: each batch adds slots / tau, then decays.
  const double decay = started_ ? std::exp(-std::max(0.0, now - last_) / tau_) : 1.0;
  std::vector<int64_t> taken(rate_.size(), 0);
  for (int32_t e : routing.expert_ids)
    if (e >= 0 && static_cast<size_t>(e) < taken.size()) ++taken[static_cast<size_t>(e)];
  for (size_t e = 0; e < rate_.size(); ++e) {
    rate_[e] = rate_[e] * decay + static_cast<double>(taken[e]) / tau_;
    total_[e] += taken[e];
    peak_[e] = std::max(peak_[e], taken[e]);
  }
  last_ = started_ ? std::max(last_, now) : now;
  started_ = true;
}

std::vector<double> ExpertLoadMeter::rates(double now) const {
  std::vector<double> out = rate_;
  if (started_) {
    const double decay = std::exp(-std::max(0.0, now - last_) / tau_);
    for (double& r : out) r *= decay;
  }
  return out;
}

std::vector<double> ExpertLoadMeter::shares() const {
  const auto all = static_cast<double>(std::accumulate(total_.begin(), total_.end(), int64_t{0}));
  std::vector<double> out(total_.size(), 0.0);
  if (all > 0)
    for (size_t e = 0; e < out.size(); ++e) out[e] = static_cast<double>(total_[e]) / all;
  return out;
}

ExpertSelection parse_expert_selection(const std::string& name) {
  if (name == "top-k") return ExpertSelection::TopK;
  if (name == "top-p") return ExpertSelection::TopP;
  throw Error("routing: unknown selection '" + name + "' (top-k or top-p)");
}

CapacityOverflow parse_capacity_overflow(const std::string& name) {
  if (name == "reroute") return CapacityOverflow::Reroute;
  if (name == "drop") return CapacityOverflow::Drop;
  throw Error("routing: unknown overflow '" + name + "' (reroute or drop)");
}

LoadBalance parse_load_balance(const std::string& name) {
  if (name == "none") return LoadBalance::None;
  if (name == "bias") return LoadBalance::Bias;
  throw Error("routing: unknown balance '" + name + "' (none or bias)");
}

}  // namespace moe
