#pragma once
/// @file
/// @brief Runs a verified plan every step on a backend, and makes all ranks agree on the plan.
///
/// The executor is a single-threaded event loop on the calling thread. Per iteration it
/// issues every communication lane's next collectives whose dependencies are satisfied, runs
/// (or, on a GPU, enqueues) at most one compute kernel, then tests every in-flight collective.
/// Testing between kernels is what progresses MPI's non-blocking collectives, which advance
/// only inside MPI calls. When nothing can be issued and nothing completed, it blocks in the
/// backend's `wait_any` with a deadline, so a hang becomes an error naming the lane and the
/// collective it waited for.
///
/// Each step is measured: per task the time it was issued and the time its completion was
/// seen, and the time the compute stream sat idle while collectives were outstanding
/// (exposed communication), attributed to the lane whose completion ended or last shortened
/// the wait. The result is a sim::result, so trace::chrome_trace draws it like a simulation.
///
/// @code
/// runtime::mpi::environment env(argc, argv);
/// runtime::mpi::backend be;
/// auto p = runtime::distribute_plan(be, [&] { return planner::make_plan(g, model, {.policy = planner::policy::concerto}); });
/// runtime::executor ex(p, be);
/// for (int i = 0; i < 10; ++i) {
///   const auto& r = ex.run_step();
///   std::printf("step %.1f us, exposed comm %.1f us\n", r.measured.step_us, r.measured.exposed_comm_us);
/// }
/// @endcode

#include <concerto/core/error.hpp>
#include <concerto/core/hash.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/plan/hash.hpp>
#include <concerto/plan/json.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/plan/verify.hpp>
#include <concerto/runtime/backend.hpp>
#include <concerto/runtime/decide.hpp>
#include <concerto/sim/simulate.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::runtime {

/// @brief How an executor runs.
struct executor_options {
  double timeout_s = default_timeout_s; ///< longest wait for any collective before the step fails
  bool timeout_from_env = true; ///< CONCERTO_TIMEOUT_S (seconds), when set, overrides timeout_s
  bool verify = true;          ///< plan::verify the plan before the first step
  /// After each compute task, look for a NaN or an infinity in what it wrote, so that a step
  /// whose loss is not finite can name where that began (step_report::first_non_finite). A
  /// debugging aid: every output is read once more. CONCERTO_FIND_NON_FINITE=1 turns it on.
  bool find_non_finite = false;
};

/// @brief What one step measured.
struct step_report {
  std::int64_t step = 0;  ///< counting from 1
  sim::result measured;   ///< times in µs from the step's start; exposed_us per lane, see file comment
  /// With executor_options::find_non_finite: this rank's first compute task of the step whose
  /// output holds a NaN or an infinity, if any.
  std::optional<non_finite_output> first_non_finite;
};

namespace detail {

inline std::string task_label(const ir::graph& g, ir::task_id id) {
  const auto& t = g.tasks[static_cast<std::size_t>(id)];
  return std::string(ir::to_string(t.kind)) + " '" + t.name + "'";
}

} // namespace detail

/// @brief Runs a plan's per-stream orders on a backend, once per `run_step`.
///
/// Construction verifies the plan (unless told not to), precomputes the cross-stream
/// dependencies and calls `backend.prepare(plan)`; after that, steps allocate nothing.
template <backend B>
class executor {
public:
  executor(plan::plan p, B& b, executor_options options = {}) : plan_(std::move(p)), b_(b), options_(options) {
    options_.timeout_s = detail::resolve_timeout_s(options_.timeout_s, options_.timeout_from_env, "executor");
    if (const char* on = std::getenv("CONCERTO_FIND_NON_FINITE"); on != nullptr && std::string_view(on) == "1")
      options_.find_non_finite = true;
    if constexpr (!finds_non_finite<B>)
      if (options_.find_non_finite)
        fail("executor: this backend cannot look for values that are not finite in the kernels' outputs "
             "(executor_options::find_non_finite, CONCERTO_FIND_NON_FINITE=1); the MPI backend can");
    if (options_.verify) plan::verify(plan_);
    const auto& g = plan_.graph;
    const auto n = g.tasks.size();
    CONCERTO_CHECK(plan_.order.size() <= g.streams.size(),
                   "executor: plan of graph '" + g.name + "' has orders for more streams than the graph");
    plan_.order.resize(g.streams.size());
    cross_deps_.assign(n, {});
    has_cross_successor_.assign(n, 0);
    std::size_t collectives = 0;
    for (const auto& t : g.tasks) {
      if (ir::is_collective(t.kind)) ++collectives;
      for (const auto d : t.deps)
        if (g.tasks[static_cast<std::size_t>(d)].stream != t.stream) {
          cross_deps_[static_cast<std::size_t>(t.id)].push_back(d);
          has_cross_successor_[static_cast<std::size_t>(d)] = 1;
        }
    }
    state_.assign(n, pending);
    pos_.assign(g.streams.size(), 0);
    slot_.assign(n, 0);
    in_flight_.reserve(collectives);
    in_flight_task_.reserve(collectives);
    auto& r = report_.measured;
    r.start_us.assign(n, 0);
    r.end_us.assign(n, 0);
    r.busy_us.assign(g.streams.size(), 0);
    r.exposed_us.assign(g.streams.size(), 0);
    r.timeline.reserve(n);
    b_.prepare(plan_);
  }

  executor(const executor&) = delete;
  executor& operator=(const executor&) = delete;

  [[nodiscard]] const plan::plan& plan() const noexcept { return plan_; }
  [[nodiscard]] const executor_options& options() const noexcept { return options_; }
  /// Number of cross-stream dependencies (what a stream-ordered backend turns into event waits).
  [[nodiscard]] std::size_t cross_stream_dependencies() const noexcept {
    std::size_t c = 0;
    for (const auto& d : cross_deps_) c += d.size();
    return c;
  }
  /// Steps run so far; the next step is number completed_steps() + 1.
  [[nodiscard]] std::int64_t completed_steps() const noexcept { return step_; }
  /// Continues the step count (optimizer bias correction) after a checkpoint of `n` steps was loaded.
  void set_completed_steps(std::int64_t n) {
    CONCERTO_CHECK(n >= 0, "executor: a step count cannot be negative");
    step_ = n;
  }
  /// The report of the last step.
  [[nodiscard]] const step_report& last() const noexcept { return report_; }

  /// @brief Runs one step; throws concerto::error (a kernel's, a backend's, or a timeout naming
  /// the lane and the collective) if the step cannot finish.
  const step_report& run_step() {
    const auto& g = plan_.graph;
    const auto n = g.tasks.size();
    std::fill(state_.begin(), state_.end(), pending);
    std::fill(pos_.begin(), pos_.end(), std::size_t{0});
    auto& r = report_.measured;
    std::fill(r.start_us.begin(), r.start_us.end(), 0.0);
    std::fill(r.end_us.begin(), r.end_us.end(), 0.0);
    std::fill(r.busy_us.begin(), r.busy_us.end(), 0.0);
    std::fill(r.exposed_us.begin(), r.exposed_us.end(), 0.0);
    r.exposed_comm_us = 0;
    r.timeline.clear();
    report_.first_non_finite.reset();
    in_flight_.clear();
    in_flight_task_.clear();
    issued_ = done_ = 0;
    idle_since_us_ = -1;
    idle_lane_ = -1;
    report_.step = ++step_;
    start_ = clock::now();
    b_.begin_step(step_);

    const auto& compute = plan_.order[ir::compute_stream];
    while (issued_ < n || (!B::stream_ordered && done_ < n)) {
      bool progressed = false;
      for (std::size_t s = 1; s < plan_.order.size(); ++s) {
        const auto& order = plan_.order[s];
        while (pos_[s] < order.size() && ready(order[pos_[s]])) {
          issue_collective(order[pos_[s]]);
          ++pos_[s];
          progressed = true;
        }
      }
      auto& cpos = pos_[ir::compute_stream];
      if (cpos < compute.size() && ready(compute[cpos])) {
        close_idle();
        run_compute(compute[cpos]);
        if (options_.find_non_finite && !report_.first_non_finite) look_for_non_finite(compute[cpos], cpos);
        ++cpos;
        progressed = true;
      } else if (idle_since_us_ < 0 && done_ < n) {
        idle_since_us_ = now_us();
      }
      for (std::size_t i = in_flight_.size(); i-- > 0;)
        if (b_.test(in_flight_[i])) {
          complete(i);
          progressed = true;
        }
      if (!progressed) block();
    }
    if (B::stream_ordered) {
      b_.end_step(); // the device has finished everything issued
      while (!in_flight_.empty()) complete(in_flight_.size() - 1);
      for (auto& st : state_) st = done;
      done_ = n;
    } else {
      b_.end_step();
    }
    close_idle();
    r.step_us = now_us();
    for (const auto& iv : r.timeline) r.busy_us[static_cast<std::size_t>(iv.stream)] += iv.end_us - iv.start_us;
    std::sort(r.timeline.begin(), r.timeline.end(), [](const sim::interval& a, const sim::interval& b) {
      return a.start_us != b.start_us ? a.start_us < b.start_us : a.stream < b.stream;
    });
    return report_;
  }

private:
  enum : std::uint8_t { pending = 0, issued = 1, done = 2 };

  double now_us() const { return std::chrono::duration<double, std::micro>(clock::now() - start_).count(); }

  bool ready(ir::task_id id) const {
    for (const auto d : plan_.graph.tasks[static_cast<std::size_t>(id)].deps) {
      const auto st = state_[static_cast<std::size_t>(d)];
      if (st == done || (B::stream_ordered && st == issued)) continue;
      return false;
    }
    return true;
  }

  void begin_task(ir::task_id id) {
    const auto& t = plan_.graph.tasks[static_cast<std::size_t>(id)];
    if (B::stream_ordered)
      for (const auto d : cross_deps_[static_cast<std::size_t>(id)])
        if (state_[static_cast<std::size_t>(d)] != done) b_.stream_wait(t.stream, plan_.graph.tasks[static_cast<std::size_t>(d)]);
    auto& r = report_.measured;
    const double at = now_us();
    r.start_us[static_cast<std::size_t>(id)] = at;
    slot_[static_cast<std::size_t>(id)] = r.timeline.size();
    r.timeline.push_back({id, t.stream, at, at});
    state_[static_cast<std::size_t>(id)] = issued;
    ++issued_;
  }

  void finish_task(ir::task_id id) {
    auto& r = report_.measured;
    const double at = now_us();
    r.end_us[static_cast<std::size_t>(id)] = at;
    r.timeline[slot_[static_cast<std::size_t>(id)]].end_us = at;
    state_[static_cast<std::size_t>(id)] = done;
    ++done_;
  }

  void issue_collective(ir::task_id id) {
    const auto& t = plan_.graph.tasks[static_cast<std::size_t>(id)];
    begin_task(id);
    in_flight_.push_back(b_.start_collective(t));
    in_flight_task_.push_back(id);
    if (B::stream_ordered && has_cross_successor_[static_cast<std::size_t>(id)]) b_.record(t);
  }

  void look_for_non_finite(ir::task_id id, std::size_t position) {
    if constexpr (finds_non_finite<B>) {
      auto found = b_.first_non_finite(plan_.graph.tasks[static_cast<std::size_t>(id)]);
      if (!found) return;
      found->task = id;
      found->position = position;
      report_.first_non_finite = found;
    }
  }

  void run_compute(ir::task_id id) {
    const auto& t = plan_.graph.tasks[static_cast<std::size_t>(id)];
    begin_task(id);
    b_.run_compute(t);
    if (B::stream_ordered && has_cross_successor_[static_cast<std::size_t>(id)]) b_.record(t);
    if (!B::stream_ordered) {
      finish_task(id);
      return;
    }
    // Enqueued, not finished: a task of another stream that needs it must still wait on its
    // event. The host-side interval is the enqueue; device times are the backend's to measure.
    const double at = now_us();
    report_.measured.end_us[static_cast<std::size_t>(id)] = at;
    report_.measured.timeline[slot_[static_cast<std::size_t>(id)]].end_us = at;
  }

  void complete(std::size_t i) {
    const auto id = in_flight_task_[i];
    finish_task(id);
    if (idle_since_us_ >= 0) idle_lane_ = plan_.graph.tasks[static_cast<std::size_t>(id)].stream;
    in_flight_[i] = in_flight_.back();
    in_flight_task_[i] = in_flight_task_.back();
    in_flight_.pop_back();
    in_flight_task_.pop_back();
  }

  void close_idle() {
    if (idle_since_us_ < 0) return;
    const double span = now_us() - idle_since_us_;
    auto& r = report_.measured;
    auto lane = idle_lane_;
    if (lane < 0 && !in_flight_task_.empty()) lane = plan_.graph.tasks[static_cast<std::size_t>(in_flight_task_.front())].stream;
    if (lane > 0) { // idle with no collective involved is not exposed communication
      r.exposed_us[static_cast<std::size_t>(lane)] += span;
      r.exposed_comm_us += span;
    }
    idle_since_us_ = -1;
    idle_lane_ = -1;
  }

  [[noreturn]] void stuck() const {
    const auto& g = plan_.graph;
    std::string heads;
    for (std::size_t s = 0; s < plan_.order.size(); ++s)
      if (pos_[s] < plan_.order[s].size())
        heads += (heads.empty() ? "" : "; ") + g.streams[s].name + " waits at task " +
                 std::to_string(plan_.order[s][pos_[s]]) + " " + detail::task_label(g, plan_.order[s][pos_[s]]);
    fail("executor: step " + std::to_string(step_) + " of graph '" + g.name +
         "' cannot proceed (the stream orders wait on each other): " + heads);
  }

  void block() {
    if (in_flight_.empty() || B::stream_ordered) stuck(); // a stream-ordered loop never waits to issue

    const auto deadline = detail::deadline_after(options_.timeout_s);
    const auto got = b_.wait_any(std::span<typename B::handle>(in_flight_), deadline);
    if (got) {
      complete(*got);
      return;
    }
    // Name the collective that has waited longest: the others may only queue behind it.
    const auto& g = plan_.graph;
    std::size_t oldest = 0;
    for (std::size_t i = 1; i < in_flight_task_.size(); ++i)
      if (report_.measured.start_us[static_cast<std::size_t>(in_flight_task_[i])] <
          report_.measured.start_us[static_cast<std::size_t>(in_flight_task_[oldest])])
        oldest = i;
    const auto id = in_flight_task_[oldest];
    const auto& t = g.tasks[static_cast<std::size_t>(id)];
    std::string where;
    if constexpr (requires { b_.whereabouts(t, std::string_view()); })
      if (auto w = b_.whereabouts(t, detail::step_wait_text(step_)); !w.empty()) where = ": " + w;
    fail(detail::timed_out_after(options_.timeout_s) + " in step " + std::to_string(step_) + " waiting for " +
         detail::task_label(g, id) + " (task " + std::to_string(id) + ") on lane '" +
         g.streams[static_cast<std::size_t>(t.stream)].name + "' of mesh axis '" +
         g.axes[static_cast<std::size_t>(t.axis)].name + "'; " + std::to_string(in_flight_.size()) +
         " collective(s) in flight" + where + " (set CONCERTO_TIMEOUT_S to wait longer)");

  }

  plan::plan plan_;
  B& b_;
  executor_options options_;
  std::vector<std::vector<ir::task_id>> cross_deps_;
  std::vector<char> has_cross_successor_;
  std::vector<std::uint8_t> state_;
  std::vector<std::size_t> pos_;
  std::vector<std::size_t> slot_;
  std::vector<typename B::handle> in_flight_;
  std::vector<ir::task_id> in_flight_task_;
  std::size_t issued_ = 0, done_ = 0;
  double idle_since_us_ = -1;
  ir::stream_id idle_lane_ = -1;
  std::int64_t step_ = 0;
  clock::time_point start_{};
  step_report report_;
};

// ---- plan agreement ---------------------------------------------------------------------

namespace detail {

inline std::string describe(const plan::collective_signature& c, const ir::graph& g) {
  const auto axis = c.axis >= 0 && static_cast<std::size_t>(c.axis) < g.axes.size()
                        ? "'" + g.axes[static_cast<std::size_t>(c.axis)].name + "'"
                        : std::to_string(c.axis);
  char bytes[32];
  std::snprintf(bytes, sizeof bytes, "%.0f", c.bytes);
  return std::string(ir::to_string(c.kind)) + " '" + c.name + "' on mesh axis " + axis + " (" + bytes + " bytes)";
}

inline nlohmann::json encode(std::uint64_t hash, const std::vector<plan::collective_signature>& seq) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& c : seq) list.push_back({c.axis, ir::to_string(c.kind), c.bytes, c.name});
  return {{"hash", hasher::to_hex(hash)}, {"collectives", std::move(list)}};
}

inline std::vector<plan::collective_signature> decode_sequence(const nlohmann::json& doc) {
  std::vector<plan::collective_signature> out;
  for (const auto& c : doc.at("collectives")) {
    const auto kind = ir::op_kind_from_string(c.at(1).get<std::string>());
    if (!kind) fail("plan agreement: rank 0 sent an unknown collective kind");
    out.push_back({c.at(0).get<int>(), *kind, c.at(2).get<double>(), c.at(3).get<std::string>()});
  }
  return out;
}

} // namespace detail

/// @brief Checks, before the first step, that every rank holds rank 0's plan; on a mismatch
/// throws concerto::error on every rank, naming the lowest differing rank and the first
/// collective where its sequence departs from rank 0's (or, if the collectives agree, the hashes).
///
/// Collective: every rank of the backend's world must call it.
/// @code
/// runtime::check_plan_agreement(backend, my_plan);  // before runtime::executor ex(my_plan, backend)
/// @endcode
template <backend B>
void check_plan_agreement(B& b, const plan::plan& p) {
  const auto mine_hash = plan::hash(p);
  const auto mine = plan::collective_sequence(p);
  std::string blob;
  if (b.rank() == 0) blob = detail::encode(mine_hash, mine).dump();
  b.broadcast(blob, 0, "the plan agreement check (rank 0's plan hash)");
  const auto doc = nlohmann::json::parse(blob);
  std::string message; // on a rank whose plan differs: where it departs from rank 0's
  if (doc.at("hash").get<std::string>() != hasher::to_hex(mine_hash)) {
    const auto ref = detail::decode_sequence(doc);
    const auto r = std::to_string(b.rank());
    for (std::size_t i = 0; i < std::max(ref.size(), mine.size()) && message.empty(); ++i) {
      if (i < ref.size() && i < mine.size() && ref[i] == mine[i]) continue;
      const auto say = [&](const std::vector<plan::collective_signature>& seq) {
        return i < seq.size() ? detail::describe(seq[i], p.graph)
                              : "nothing (its sequence ends after " + std::to_string(seq.size()) + " collectives)";
      };
      message = "plan agreement failed before the first step: rank " + r + " differs from rank 0 at collective " +
                std::to_string(i) + ": rank 0 issues " + say(ref) + ", rank " + r + " issues " + say(mine) +
                "; running would hang or exchange the wrong buffers";
    }
    if (message.empty())
      message = "plan agreement failed before the first step: rank " + r + "'s plan (hash " + hasher::to_hex(mine_hash) +
                ") differs from rank 0's (hash " + doc.at("hash").get<std::string>() +
                ") although their collective sequences agree; every rank must run rank 0's plan";
  }
  stop_together(std::move(message), b, "the plan agreement check");
}

/// @brief Rank 0 makes the plan (plans or loads it from the cache) and broadcasts its JSON;
/// every rank reads it, verifies it and checks agreement. A failure on rank 0 is rethrown on
/// every rank with rank 0's message.
/// @code
/// auto p = runtime::distribute_plan(backend, [&] { return planner::make_plan(g, model); });
/// @endcode
template <backend B>
[[nodiscard]] plan::plan distribute_plan(B& b, const std::function<plan::plan()>& make_on_root) {
  // Rank 0 too reads the plan back from the bytes sent: every rank runs the very plan it hashes.
  auto p = plan::plan_from_json(decide_on_rank_0(b, "the plan from rank 0 (rank 0 plans, or loads it from the cache)",
                                                 "rank 0 could not make the plan",
                                                 [&] { return plan::to_json(make_on_root()); }));
  plan::verify(p);
  check_plan_agreement(b, p);
  return p;
}

} // namespace concerto::runtime
