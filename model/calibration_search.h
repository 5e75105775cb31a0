// The calibration search: what a codec needs from a model's KV, learned on calibration text (as
// token ids) — SKVQ's channel orders (by range) and clip ratios (by attention-output error), and
// the per-layer codec choices for a budget (TaDA's precision search, the Strata mix). `strata
// calibrate` writes the result to a file; a serving node may run it itself.
//
// Thread-safe: the model is only read; the per-layer loss increases the layer search measures
// are kept in a process-wide cache (guarded by a mutex) keyed by everything they depend on, so
// searching several budgets on the same text measures them once.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/calibration.h"
#include "model/llama.h"

namespace strata::model {

struct CalibrationSearchOptions {
  uint32_t chunk_tokens = 256;   // tokens per compressed block, as the cache will use
  uint32_t window_tokens = 0;    // full-precision window, as the cache will use (layer search)
  uint32_t context = 1024;       // tokens per forward window
  uint32_t windows = 2;          // windows of calibration text
  // CQ's k-means takes at least this many windows (as far as the text goes): 2^b centroids per
  // channel run need many more points than channel orders or clip ratios do.
  uint32_t codebook_windows = 8;
  uint32_t error_queries = 64;   // queries whose attention output the clip search minimizes
  // CQ's k-means weighs each token's K and V by the attention it receives from the queries after
  // it in its window (CQ's Fisher-guided centroids, estimated without gradients); false: 1 each.
  bool cq_attention_weights = true;
  // CQ's keys are learned and encoded under a per-channel metric from the calibration's queries
  // (LayerCalibration::k_metric: a key's error weighed by how much it moves q.k); false: the
  // plain distance.
  bool cq_query_metric = false;
  // CQ's values are learned and encoded under a per-channel metric from the output projection
  // (LayerCalibration::v_metric: a value's error weighed by how much it moves the layer's
  // output); false: the plain distance.
  bool cq_output_metric = false;
  // The layer search's joint step: the per-layer search adds up each layer's loss measured alone,
  // which misses how layers' errors combine. The `joint_choices` best choices by that sum are
  // each measured whole (every layer compressed at once), and the one kept is the most
  // greedy-agreeing (top-1 against fp16) of those whose KL is within `joint_kl_slack` of the
  // least. 1: the sum's best, unmeasured.
  // The joint step measures each choice over `joint_windows` windows (as far as the text goes,
  // and as its fp16 reference's logits fit in 1 GiB; at least `windows`): choices this close
  // apart need more text than the per-layer search's many measurements can each afford.
  uint32_t joint_choices = 8;
  double joint_kl_slack = 0.05;
  uint32_t joint_windows = 8;
  std::string source;            // recorded in the calibration (with the token count)
  // Called after each layer of each search stage ("SKVQ clip ratios", "layer choices"): the
  // layers done and the stage's total, for a progress display. Optional.
  std::function<void(absl::string_view stage, uint32_t done, uint32_t total)> progress = nullptr;
};

// What `codec_spec` needs from `model`'s KV on the token ids `ids` (BOS included): SKVQ's
// channel orders and clip ratios; per-layer codec choices for a budget (TaDA, the Strata mix). A
// codec that needs nothing gets an empty calibration for the model (codec, fingerprint and
// shape, no layers).
// Errors: kInvalidArgument for a bad spec, text shorter than one window of `context` tokens, a
// window with no full chunk before the error queries, or a budget no per-layer choice fits; the
// model's and codecs' errors otherwise.
absl::StatusOr<kernels::Calibration> SearchCalibration(const LlamaModel& model,
                                                       const std::vector<uint32_t>& ids,
                                                       const std::string& codec_spec,
                                                       const CalibrationSearchOptions& options);

// The `k` choices of one candidate per layer with the least summed delta[layer][candidate] whose
// summed cost[candidate] is at most `cap`, best first (fewer where fewer fit; none where none
// does): a multiple-choice knapsack, exact by dynamic programming over the cost, keeping the k
// best partial sums of every state. Each choice lists a candidate per layer.
std::vector<std::vector<int>> BestLayerChoices(const std::vector<std::vector<double>>& delta,
                                               const std::vector<int>& cost, int cap, size_t k);

}  // namespace strata::model
