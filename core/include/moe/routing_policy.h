// gst-moe: routing policies — how one batch's router logits become each row's experts and
// weights (docs/routing.md has the definitions, their sources and the measurements).
//
//   temperature   probabilities are softmax(logits / T) in f32; T = 1 is the model's own routing.
//   selection     top-k: the k most probable experts; top-p: the smallest set, most probable
//                 first, whose probability reaches p (Huang et al. 2024, "Harder Tasks Need More
//                 Experts"), clamped to [min_k, max_k].
//   balance       bias: a per-expert bias added to the probabilities for selection only (the
//                 weights stay the unbiased probabilities), moved after every batch by
//                 balance_rate towards equal load: down for experts above the mean load, up for
//                 those below (DeepSeek-V3's auxiliary-loss-free balancing). It reorders only the
//                 experts within balance_margin of the row's k-th probability, so a row is never
//                 steered to an expert the router rates far lower (1: no limit, as DeepSeek-V3).
//   explore       with probability explore, a row's last slot goes to the least-used expert it
//                 does not already use (fewest slots since the last reset, counting this batch's explored
//                 slots; ties to the lower id)
//                 — so a new expert gets traffic. A row with one expert gains the explored one
//                 as a second slot when the policy allows two, and is not explored otherwise.
//   capacity      capacity_factor C > 0: each expert takes at most ceil(C · rows · mean_k / E)
//                 slots of a batch. Slots are placed by priority — every row's first choice
//                 before any second choice, and within one rank the rows with the highest
//                 probability for that slot first (V-MoE's batch-prioritised routing), ties to
//                 the earlier row. A slot that finds its expert full goes to the row's next most
//                 probable expert with room (reroute), or is dropped (drop).
//   weights       each kept slot's unbiased probability, renormalised over the row's kept slots
//                 when `renormalize` (Mixtral; Qwen2-MoE's norm_topk_prob).
//
// A -inf logit marks an expert the row may not use (MoeLayer::router_logits masks the joint
// experts of single-modality rows so): it has probability 0 and is never selected, explored or
// rerouted to, a row takes at most its eligible experts, and experts that no row of the batch
// may use count neither in the capacity nor in the balancing (their bias stays). A batch whose
// rows all mask the same experts thus routes exactly as it would without those experts. A row of
// -inf only is routed as equal logits.
//
// Rows may end with different numbers of experts: Routing::top_k is then the most any row can
// have, and a row's unused slots hold expert -1 with weight 0, after its used ones (which are in
// descending order of weight). A row whose every slot was dropped has only -1 slots.
//
// Threads: a Router is used by one thread at a time (moe-route's streaming thread).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moe/moe_layer.h"

namespace moe {

enum class ExpertSelection { TopK, TopP };
enum class CapacityOverflow { Reroute, Drop };
enum class LoadBalance { None, Bias };

struct RoutingPolicy {
  ExpertSelection selection = ExpertSelection::TopK;
  int top_k = 2;       // top-k: experts per row, 1..E
  double top_p = 0.5;  // top-p: probability to reach, (0, 1]
  int min_k = 1;       // top-p: bounds on experts per row, 1 <= min_k <= max_k <= E
  int max_k = 4;
  double temperature = 1.0;      // > 0
  double capacity_factor = 0.0;  // 0: no capacity limit; else > 0
  CapacityOverflow overflow = CapacityOverflow::Reroute;
  LoadBalance balance = LoadBalance::None;
  double balance_rate = 1e-3;  // bias step per batch, >= 0
  // The bias reorders only the experts whose probability is within this of the row's k-th most
  // probable (k = top_k; min_k for top-p), in [0, 1]; 1: no limit (DeepSeek-V3's rule).
  double balance_margin = 0.05;
  double explore = 0.0;  // probability in [0, 1]
  uint64_t seed = 0;     // for explore
  bool renormalize = true;

  // True when the policy is the model's own top-k routing (temperature 1, no capacity, no
  // balancing, no exploration): MoeLayer::route(x, top_k) computes it on the layer's backend.
  bool is_plain_top_k() const;
  // Slots per row in the Routing it produces: top_k, or max_k for top-p.
  int slots() const;
  // Throws moe::Error naming the first field out of range for `num_experts` experts.
  void validate(int num_experts) const;
};

// Per-expert load, counted over the batches routed since the last reset.
struct ExpertLoad {
  std::vector<int64_t> slots;       // slots routed to each expert
  std::vector<int64_t> peak;        // most slots of one batch, per expert
  std::vector<int64_t> overflowed;  // slots that found the expert full (rerouted or dropped)
  std::vector<int64_t> explored;    // slots given to the expert by exploration
  int64_t rows = 0, batches = 0, dropped = 0;
  // Coefficient of variation (standard deviation / mean) of `slots` across experts; 0 when none.
  double coefficient_of_variation() const;
};

class Router {
 public:
  // Throws moe::Error when the policy is out of range for `num_experts`.
  Router(int num_experts, const RoutingPolicy& policy);

  // Routes `rows` rows of logits (row-major rows x num_experts, as MoeLayer::router_logits
  // returns them), then updates the balancing bias and the load counters.
  Routing route(const float* logits, int64_t rows);
  // Counts a batch routed elsewhere (the plain top-k on the backend) in the load figures.
  void count(const Routing& routing);
  // Back to the state after construction: zero bias, counters and the exploration stream.
  void reset();

  const RoutingPolicy& policy() const { return policy_; }
  const std::vector<float>& bias() const { return bias_; }
  const ExpertLoad& load() const { return load_; }

 private:
  int experts_;
  RoutingPolicy policy_;
  std::vector<float> bias_;
  ExpertLoad load_;
  std::mt19937_64 rng_;
};

// Per-expert load as operators watch it: routed slots per second (an exponentially decaying
// rate with time constant `tau_seconds`), each expert's share of all slots, and the most slots an
// expert took in one batch. Times are seconds on any monotonic clock. Threads: one at a time.
class ExpertLoadMeter {
 public:
  ExpertLoadMeter(int num_experts, double tau_seconds);
  // One batch's routing at time `now` (unused slots are not counted).
  void add(const Routing& routing, double now);
  // Slots per second per expert at `now` (decayed since the last batch).
  std::vector<double> rates(double now) const;
  // Share of all slots so far per expert (zeros before any slot).
  std::vector<double> shares() const;
  const std::vector<int64_t>& peak() const { return peak_; }

 private:
  double tau_;
  double last_ = 0.0;
  bool started_ = false;
  std::vector<double> rate_;
  std::vector<int64_t> total_, peak_;
};

// "top-k" / "top-p"; "reroute" / "drop"; "none" / "bias". Throw moe::Error naming the value.
ExpertSelection parse_expert_selection(const std::string& name);
CapacityOverflow parse_capacity_overflow(const std::string& name);
LoadBalance parse_load_balance(const std::string& name);

}  // namespace moe
