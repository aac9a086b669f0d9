#pragma once
// The text-trained examples' trainer (GPT, Llama), for one plan: batches from token shards
// (--data DIR: each data-parallel rank reads its own rows) or from the text, global-norm
// clipping (--clip), validation every N steps on the held-out shards (--val-every), checkpoints
// that keep the data loader's position (--save, --save-every, --resume: a resumed run continues
// with the exact next batch), one progress line per --log-every steps (loss, learning rate,
// gradient norm, tokens/s, model FLOP/s (MFU against a GPU preset's peak), ETA; under fp16 the
// steps its loss scaling skipped), a JSONL record per step
// (--metrics FILE) and the trained parameters in safetensors (--export).
#include "corpus.hpp"
#include "settings.hpp"

#include <concerto/core/error.hpp>
#include <concerto/core/file.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/data/token_shards.hpp>
#include <concerto/train/step.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace examples {

/// Rows [first, first + rows) of a global batch of `seq`-token sequences: ids and their
/// next-token labels, row-major.
struct token_rows {
  std::int64_t first = 0, rows = 0, seq = 0;
  std::vector<std::int64_t> ids, labels;
};

/// A loader that serves the step's shards of `ids`, `labels` and `positions` (0..seq-1, rope's)
/// from the rows it holds; a shard outside them is an error naming both.
inline concerto::train::loader serve(const token_rows& r) {
  return [&r](const concerto::train::shard_request& q) {
    const bool rows_only = q.local_shape.size() == 2 && q.local_shape[1] == r.seq && q.offset[1] == 0;
    const auto first = q.offset.at(0), rows = q.local_shape.at(0);
    if (!rows_only || first < r.first || first + rows > r.first + r.rows)
      concerto::fail("input '" + q.name + "': the step wants rows [" + std::to_string(first) + ", " +
                     std::to_string(first + rows) + ") of " + std::to_string(q.local_shape.size() == 2 ? q.local_shape[1] : 0) +
                     " tokens, this rank read rows [" + std::to_string(r.first) + ", " + std::to_string(r.first + r.rows) +
                     ") of " + std::to_string(r.seq) + "; the data-parallel slice does not match the mesh");
    if (q.i64.empty()) concerto::fail("input '" + q.name + "' is not token ids");
    for (std::int64_t row = 0; row < rows; ++row)
      for (std::int64_t t = 0; t < r.seq; ++t) {
        const auto at = static_cast<std::size_t>((first - r.first + row) * r.seq + t);
        auto& out = q.i64[static_cast<std::size_t>(row * r.seq + t)];
        if (q.name == "ids") out = r.ids[at];
        else if (q.name == "labels") out = r.labels[at];
        else if (q.name == "positions") out = t;
        else concerto::fail("input '" + q.name + "' is none of ids, labels, positions");
      }
  };
}

/// This rank's slice of each global batch: its coordinate over the mesh axes that split the
/// tokens' rows (`token_axes`, in the spec's order, the first major).
inline concerto::dataset::rank_slice slice_of(const concerto::mesh& m, int rank, const std::vector<std::string>& token_axes) {
  concerto::dataset::rank_slice s{0, 1};
  const auto coords = m.coords(rank);
  for (const auto& name : token_axes) {
    const auto a = m.index_of(name);
    if (!a) continue;
    const int size = m.axes()[static_cast<std::size_t>(*a)].size;
    s.rank = s.rank * size + coords[static_cast<std::size_t>(*a)];
    s.ranks *= size;
  }
  return s;
}

/// Where the batches come from: token shards (DIR/train*.bin, validation DIR/val*.bin), or the
/// text's characters (random windows every rank draws alike, from a fixed seed; no validation).
class batch_source {
public:
  batch_source(const text_model_settings& s, concerto::dataset::rank_slice slice) : s_(s), slice_(slice) {
    if (s.data.empty()) {
      corpus_ = read_corpus(s.text, s.seq);
      vocab_ = corpus_->vocab;
      return;
    }
    vocab_ = s.vocab;
    const auto dir = std::filesystem::path(s.data);
    train_.emplace(concerto::dataset::loader_options{.files = concerto::dataset::shards_in(dir, "train"),
                                                      .batch = s.batch,
                                                      .seq = s.seq,
                                                      .seed = s.seed},
                   slice);
    if (s.val_every > 0)
      val_options_ = concerto::dataset::loader_options{
          .files = concerto::dataset::shards_in(dir, "val"), .batch = s.batch, .seq = s.seq, .shuffle = false};
  }

  [[nodiscard]] std::int64_t vocab() const noexcept { return vocab_; }
  [[nodiscard]] std::string describe() const {
    if (corpus_) return std::to_string(corpus_->text.size()) + " chars of " + s_.text;
    return std::to_string(train_->windows()) + " windows of " + std::to_string(s_.seq + 1) + " tokens in " + s_.data +
           "/train*.bin (" + std::to_string(train_->batches_per_epoch()) + " batches per epoch)";
  }

  /// The next training batch: this rank's rows.
  [[nodiscard]] token_rows next() {
    if (train_) return rows_of(train_->next());
    token_rows r{0, s_.batch, s_.seq, {}, {}};
    const auto& text = corpus_->text;
    for (int b = 0; b < s_.batch; ++b) {
      text_state_ = concerto::train::detail::mix(text_state_);
      const auto at = text_state_ % (text.size() - static_cast<std::size_t>(s_.seq) - 1);
      for (int t = 0; t < s_.seq; ++t) {
        r.ids.push_back(corpus_->id_of[static_cast<unsigned char>(text[at + static_cast<std::size_t>(t)])]);
        r.labels.push_back(corpus_->id_of[static_cast<unsigned char>(text[at + static_cast<std::size_t>(t) + 1])]);
      }
    }
    return r;
  }

  /// The first `count` validation batches (the same every time: no shuffle), this rank's rows.
  [[nodiscard]] std::vector<token_rows> validation(int count) const {
    concerto::dataset::token_loader val(*val_options_, slice_);
    std::vector<token_rows> out;
    for (int i = 0; i < count && static_cast<std::uint64_t>(i) < val.batches_per_epoch(); ++i) out.push_back(rows_of(val.next()));
    return out;
  }

  /// Where the next batch comes from, for a checkpoint.
  [[nodiscard]] nlohmann::json position() const {
    if (train_) return {{"epoch", train_->where().epoch}, {"batch", train_->where().batch}, {"seed", s_.seed}};
    return {{"text_state", text_state_}};
  }
  void seek(const nlohmann::json& p) {
    if (train_) {
      if (!p.contains("epoch") || p.value("seed", s_.seed) != s_.seed)
        concerto::fail("--resume: the checkpoint's data position is not of these shards with --seed " + std::to_string(s_.seed));
      train_->seek({p.at("epoch").get<std::uint64_t>(), p.at("batch").get<std::uint64_t>()});
    } else {
      if (!p.contains("text_state")) concerto::fail("--resume: the checkpoint was written by a run on token shards (--data)");
      text_state_ = p.at("text_state").get<std::uint64_t>();
    }
  }

private:
  // A loader's batch as the rows of the global batch it is: this rank's slice.
  [[nodiscard]] token_rows rows_of(concerto::dataset::batch b) const {
    return {slice_.rank * static_cast<std::int64_t>(b.rows), b.rows, b.seq, std::move(b.ids), std::move(b.labels)};
  }

  const text_model_settings& s_;
  concerto::dataset::rank_slice slice_;
  std::optional<corpus> corpus_;
  std::optional<concerto::dataset::token_loader> train_;
  std::optional<concerto::dataset::loader_options> val_options_;
  std::uint64_t text_state_ = 12345; ///< the text's window draws, every rank alike
  std::int64_t vocab_ = 0;
};

/// FLOPs of one training step per token, forward and backward: 6 per parameter (matmuls) and
/// the attention's scores and weighted sums, 12 · layers · hidden · seq (PaLM's count).
template <class Step>
double flops_per_token(Step& step, int layers, int hidden, int seq) {
  double params = 0;
  for (const auto& name : step.parameter_names()) {
    double n = 1;
    for (const auto d : step.global_shape(name)) n *= static_cast<double>(d);
    params += n;
  }
  return 6.0 * params + 12.0 * layers * hidden * static_cast<double>(seq);
}

inline std::string clock_text(double seconds) {
  const auto s = static_cast<long long>(std::max(0.0, seconds));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  return buf;
}

/// What a run measured: its first loss and the moving average at its end, and every step's
/// measured time (the first, which also warms caches, left out).
struct run_stats {
  double first = std::nan(""), last = std::nan("");
  std::vector<double> step_us, exposed_us;
};

/// Trains `step` to --steps (from a checkpoint with --resume). Collective; rank 0 prints and
/// writes.
template <class Step>
run_stats train(Step& step, const text_model_settings& s, batch_source& source, int layers, int hidden) {
  const bool root = step.rank() == 0;
  const int world = concerto::runtime::mpi::environment::world_size();
  if (!s.resume.empty()) {
    const auto state = step.load(s.resume);
    if (!state.is_object() || !state.contains("data"))
      concerto::fail("--resume " + s.resume + ": the checkpoint has no data position (write it with --save)");
    source.seek(state.at("data"));
    if (root) std::printf("resumed from %s after step %lld\n", s.resume.c_str(), static_cast<long long>(step.completed_steps()));
  }
  const auto save = [&](const std::string& path) {
    step.save(path, {{"data", source.position()}, {"example", "text"}});
    if (root) std::printf("checkpoint %s (step %lld)\n", path.c_str(), static_cast<long long>(step.completed_steps()));
  };
  std::vector<token_rows> val;
  if (s.val_every > 0) val = source.validation(s.val_batches);
  const auto validate = [&] {
    double sum = 0;
    for (const auto& rows : val) sum += step.evaluate(serve(rows));
    return val.empty() ? std::nan("") : sum / static_cast<double>(val.size());
  };
  std::ofstream metrics;
  if (root && !s.metrics.empty()) {
    metrics.open(s.metrics, s.resume.empty() ? std::ios::trunc : std::ios::app);
    if (!metrics) concerto::fail("--metrics: cannot write '" + s.metrics + "'");
  }
  const double per_token = flops_per_token(step, layers, hidden, s.seq);
  // MFU only against a GPU's peak: the cpu presets' peaks are planning figures, not this core's
  // (its measured sgemm rate can pass them), so on CPU ranks the line gives model FLOP/s a rank.
  const bool gpu_peak = s.cost_preset.rfind("cpu", 0) != 0;
  const double peak = concerto::cost::model::preset(s.cost_preset).hw().peak_tflops * 1e12 * world;
  const double tokens = static_cast<double>(s.batch) * s.seq;
  run_stats out;
  double window_s = 0;
  int window = 0;
  const auto start = step.completed_steps();
  while (step.completed_steps() < s.steps) {
    const auto rows = source.next();
    const auto began = std::chrono::steady_clock::now();
    const auto r = step(serve(rows));
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    if (std::isnan(out.first)) {
      out.first = out.last = r.loss;
    } else {
      out.last = 0.9 * out.last + 0.1 * r.loss;
      out.step_us.push_back(r.step_us);
      out.exposed_us.push_back(r.exposed_comm_us);
    }
    window_s += wall;
    ++window;
    const double tok_s = tokens / wall, mfu = per_token * tokens / wall / peak;
    double val_loss = std::nan("");
    if (s.val_every > 0 && (r.step % s.val_every == 0 || r.step == s.steps)) val_loss = validate();
    if (root && metrics.is_open()) {
      nlohmann::json line{{"step", r.step}, {"loss", r.loss}, {"lr", r.lr}, {"step_s", wall}, {"tokens_per_s", tok_s},
                          {"model_tflops", per_token * tok_s / 1e12}, {"exposed_comm_us", r.exposed_comm_us}};
      if (gpu_peak) line["mfu"] = mfu;
      if (!std::isnan(r.grad_norm)) line["grad_norm"] = r.grad_norm;
      if (r.loss_scale != 1.0f) line["loss_scale"] = r.loss_scale;
      if (r.skipped) line["skipped"] = true;
      if (!std::isnan(val_loss)) line["val_loss"] = val_loss;
      metrics << line.dump() << '\n' << std::flush;
    }
    if (root && r.skipped)
      std::printf("step %5lld  skipped: a gradient overflowed f16 at loss scale %g (now %g)\n", static_cast<long long>(r.step),
                  static_cast<double>(r.loss_scale), static_cast<double>(r.loss_scale) * 0.5);
    if (root && !r.skipped && (r.step % s.log_every == 0 || r.step == s.steps || r.step == start + 1)) {
      const double mean_s = window_s / window;
      char norm[32] = "", rate[48] = "";
      if (!std::isnan(r.grad_norm)) std::snprintf(norm, sizeof norm, "  norm %.3f", r.grad_norm);
      if (gpu_peak) std::snprintf(rate, sizeof rate, "MFU %.2f%%", 100.0 * per_token * tokens / mean_s / peak);
      else std::snprintf(rate, sizeof rate, "%.1f GFLOP/s/rank", per_token * tokens / mean_s / 1e9 / world);
      std::printf("step %5lld/%d  loss %.4f  lr %.2e%s  %8.0f tok/s  %s  ETA %s\n", static_cast<long long>(r.step), s.steps,
                  r.loss, static_cast<double>(r.lr), norm, tokens / mean_s, rate,
                  clock_text(mean_s * static_cast<double>(s.steps - r.step)).c_str());
      window_s = 0;
      window = 0;
    }
    if (root && !std::isnan(val_loss)) std::printf("step %5lld  val loss %.4f (%zu batches)\n", static_cast<long long>(r.step), val_loss, val.size());
    if (root) std::fflush(stdout);
    if (!s.save.empty() && s.save_every > 0 && r.step % s.save_every == 0 && r.step < s.steps) save(s.save);
  }
  if (!s.save.empty()) save(s.save);
  return out;
}

/// Trains every compiled step: one with train() above; several (plans compared) in turn on the
/// same batches, the order rotating each round, without the trainer's options (the command line
/// refuses them).
template <class Step>
std::vector<run_stats> train_all(std::vector<Step>& runs, const text_model_settings& s, batch_source& source, int layers,
                                 int hidden) {
  std::vector<run_stats> stats(runs.size());
  if (runs.size() == 1) {
    stats[0] = train(runs[0], s, source, layers, hidden);
    return stats;
  }
  for (int i = 0; i < s.steps; ++i) {
    const auto rows = source.next();
    for (std::size_t j = 0; j < runs.size(); ++j) {
      const std::size_t p = (j + static_cast<std::size_t>(i)) % runs.size(); // rotate who goes first
      const auto r = runs[p](serve(rows));
      auto& st = stats[p];
      st.last = i == 0 ? r.loss : 0.9 * st.last + 0.1 * r.loss;
      if (i == 0) {
        st.first = r.loss;
      } else { // the first step also warms caches
        st.step_us.push_back(r.step_us);
        st.exposed_us.push_back(r.exposed_comm_us);
      }
    }
  }
  return stats;
}

/// After training: every plan's result to --json (rank 0), the first plan's parameters to
/// --export (each plan trains the same model, up to rounding). Collective.
template <class Step>
void write_results(std::vector<Step>& runs, const text_model_settings& s, const nlohmann::json& results) {
  const bool root = runs.front().rank() == 0;
  if (root && !s.json.empty()) concerto::write_file_atomically(s.json, results.dump(2) + "\n");
  if (s.export_path.empty()) return;
  runs.front().export_safetensors(s.export_path, s.export_dtype == "bf16" ? concerto::train::safetensors::dtype::bf16
                                                                          : concerto::train::safetensors::dtype::f32);
  if (root) std::printf("parameters written to %s (safetensors, %s)\n", s.export_path.c_str(), s.export_dtype.c_str());
}

} // namespace examples
