#pragma once
/// @file
/// @brief The job's side channel: point-to-point messages on reserved tags of MPI_COMM_WORLD
/// that say where each rank is, so that a timeout can name the ranks that did not arrive and a
/// failure is printed once.
///
/// Three things travel on it, all from the main thread, all non-blocking:
/// - **where a rank waits.** Every wait of the library (control-path collectives, the
///   executor's collectives, the end of the job) marks what it waits for (`waiting`) and
///   answers questions from other ranks while it polls (`serve`). A rank that times out asks
///   the ranks it waited with (`whereabouts`) and says, per rank, whether it is waiting
///   elsewhere (naming where), has failed, is busy with something it announced (`announce`:
///   rank 0 planning), or does not answer at all (stopped, or inside a computation).
/// - **failures.** A rank whose body throws reports its message to world rank 0
///   (`report_failure`), which prints every distinct message once: its own and those that
///   reached it (run_or_abort). Rank 0, when it next waits, takes a report as its own failure
///   (a `remote_failure`), so a failure of one rank is printed by rank 0 once and the job ends.
/// - **notices.** A rank about to be busy outside any wait for a while (rank 0 planning) says
///   so to every rank; the notice is withdrawn when it is done.
///
/// Point-to-point messages match no collective, so this channel works even where the ranks'
/// collective algorithms differ (the very fault the settings agreement reports). The tags are
/// the four highest MPI allows (MPI_TAG_UB and below): a program that receives with
/// MPI_ANY_TAG on MPI_COMM_WORLD could take one of these messages.
///
/// @code
/// auto& ch = runtime::mpi::channel::get();
/// runtime::mpi::channel::waiting w(ch, "the loss of step 12");
/// while (!done) ch.serve();                       // answers other ranks' questions
/// std::string who = ch.whereabouts({1, 2, 3}, 1.0); // "rank 2 is waiting for ...; rank 3 does not answer ..."
/// @endcode

#include <concerto/core/error.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace concerto::runtime::mpi {

/// @brief Another rank's failure, taken by world rank 0 while it waited: the job ends with it.
struct remote_failure : error {
  remote_failure(int from, std::string what)
      : error("concerto: rank " + std::to_string(from) + " failed: " + what), rank(from), text(std::move(what)) {}
  int rank;
  std::string text; ///< the failing rank's message, as it reported it
};

/// @brief One rank's failure message, as rank 0 collected it.
struct failure_report {
  int rank = 0;
  std::string text;
};

class channel {
public:
  using clock = std::chrono::steady_clock;

  /// @brief The process's channel (one per process: a rank is a process). MPI must be initialised.
  [[nodiscard]] static channel& get() {
    static channel c;
    return c;
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }

  /// @brief Marks what this rank waits for while it lives (innermost wins); the answer to
  /// other ranks' questions.
  class waiting {
  public:
    waiting(channel& c, std::string what) : c_(c) { c_.activities_.push_back({std::move(what), clock::now()}); }
    waiting(const waiting&) = delete;
    waiting& operator=(const waiting&) = delete;
    ~waiting() { c_.activities_.pop_back(); }

  private:
    channel& c_;
  };

  /// @brief Announces `what` (announce) while it lives, e.g. rank 0's planning, so that a rank
  /// that times out waiting for it says "rank 0 is planning the step (12 s so far)".
  class busy {
  public:
    busy(channel& c, const std::string& what) : c_(c) { c_.announce(what); }
    busy(const busy&) = delete;
    busy& operator=(const busy&) = delete;
    ~busy() { c_.announce(""); }

  private:
    channel& c_;
  };

  /// @brief Says to every other rank what this rank is about to be busy with outside any wait
  /// (e.g. "planning"); an empty text withdraws it. Each rank keeps the latest it heard.
  void announce(const std::string& what) {
    for (int r = 0; r < size_; ++r)
      if (r != rank_) send(what, r, tag_notice_);
  }

  /// @brief Answers other ranks' questions, keeps their notices and, on world rank 0 when
  /// `take_failures`, throws a remote_failure for a rank that reported one. Cheap; called from
  /// every wait's poll loop.
  void serve(bool take_failures = true) {
    complete_sends();
    int flag = 1;
    MPI_Status st;
    while (probe(tag_query_, flag, st), flag) {
      const int from = st.MPI_SOURCE;
      send(receive(st) + answer(), from, tag_reply_); // the question's id, then the answer
    }
    while (probe(tag_notice_, flag, st), flag) {
      auto text = receive(st);
      if (text.empty()) notices_.erase(st.MPI_SOURCE);
      else notices_[st.MPI_SOURCE] = {std::move(text), clock::now()};
    }
    if (take_failures && rank_ == 0)
      if (probe(tag_failure_, flag, st), flag) {
        const int from = st.MPI_SOURCE;
        throw remote_failure(from, receive(st));
      }
  }

  /// @brief Asks `ranks` (world ranks; this one is skipped) where they are and waits up to
  /// `grace_s` for the answers, serving meanwhile. One phrase per group of ranks in the same
  /// state, e.g. "ranks 1, 3 do not answer (stopped, or busy outside concerto's waits)"; the
  /// ranks that wait for `same` (what this rank waits for) are left out. Empty when every rank
  /// asked waits for `same`.
  [[nodiscard]] std::string whereabouts(std::span<const int> ranks, double grace_s, std::string_view same) {
    const std::int64_t id = ++queries_;
    std::string tag(sizeof id, '\0');
    std::memcpy(tag.data(), &id, sizeof id);
    std::vector<int> asked;
    for (const int r : ranks)
      if (r != rank_ && r >= 0 && r < size_) {
        send(tag, r, tag_query_);
        asked.push_back(r);
      }
    std::map<int, std::string> answers; // what each answered, in words
    const auto until = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(grace_s));
    while (answers.size() < asked.size() && clock::now() < until) {
      serve(false);
      int flag = 0;
      MPI_Status st;
      while (probe(tag_reply_, flag, st), flag) {
        const int from = st.MPI_SOURCE;
        const auto reply = receive(st);
        if (reply.size() >= sizeof id + 1 + sizeof(double) && reply.compare(0, sizeof id, tag) == 0)
          answers[from] = reply.substr(sizeof id);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    // Group the ranks by what is said of them, in rank order of each group's first.
    std::vector<std::pair<std::string, std::vector<int>>> groups;
    for (const int r : asked) {
      std::string said;
      if (const auto it = answers.find(r); it != answers.end()) {
        const char kind = it->second[0];
        double secs = 0;
        std::memcpy(&secs, it->second.data() + 1, sizeof secs);
        const std::string_view what = std::string_view(it->second).substr(1 + sizeof secs);
        if (kind == 'w' && what == same) continue;
        char time[32];
        std::snprintf(time, sizeof time, "%.1f", secs);
        said = kind == 'w'   ? "is waiting for " + std::string(what) + " (" + time + " s so far)"
               : kind == 'f' ? "failed: " + std::string(what)
                             : "is running (between the library's waits)";
      } else if (const auto n = notices_.find(r); n != notices_.end()) {
        char secs[32];
        std::snprintf(secs, sizeof secs, "%.0f", std::chrono::duration<double>(clock::now() - n->second.since).count());
        said = "is " + n->second.text + " (" + secs + " s so far)";
      } else {
        said = "does not answer (stopped, or busy outside concerto's waits)";
      }
      const auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == said; });
      if (g == groups.end()) groups.push_back({said, {r}});
      else g->second.push_back(r);
    }
    std::string out;
    for (const auto& [said, who] : groups) {
      std::string list;
      for (std::size_t k = 0; k < who.size() && k < 16; ++k) list += (k ? ", " : "") + std::to_string(who[k]);
      if (who.size() > 16) list += ", ...";
      out += (out.empty() ? "" : "; ") + std::string(who.size() == 1 ? "rank " : "ranks ") + list + " " +
             (who.size() == 1 ? said : plural(said));
    }
    return out;
  }

  /// @brief A failing rank other than world rank 0: sends its message to rank 0.
  void report_failure(const std::string& text) {
    failed_ = text;
    if (rank_ != 0) send(text, 0, tag_failure_);
  }

  /// @brief World rank 0, failing: the reports of other ranks that arrive within `grace_s`
  /// (sooner once every other rank has reported), serving meanwhile.
  [[nodiscard]] std::vector<failure_report> collect_failures(double grace_s) {
    std::vector<failure_report> out;
    const auto until = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(grace_s));
    while (static_cast<int>(out.size()) < size_ - 1 && clock::now() < until) {
      serve(false);
      int flag = 0;
      MPI_Status st;
      while (probe(tag_failure_, flag, st), flag) {
        const int from = st.MPI_SOURCE;
        out.push_back({from, receive(st)});
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return out;
  }

  /// @brief Serves for `seconds` (a failing rank waiting for rank 0 to end the job).
  void serve_for(double seconds) {
    const auto until = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(seconds));
    while (clock::now() < until) {
      serve(false);
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
  }

  /// @brief Before MPI_Finalize: what was sent and never taken is let go.
  void close() {
    for (auto& s : sends_)
      if (s.request != MPI_REQUEST_NULL) {
        int done = 0;
        MPI_Test(&s.request, &done, MPI_STATUS_IGNORE);
        if (!done) {
          MPI_Cancel(&s.request);
          MPI_Request_free(&s.request);
        }
      }
    sends_.clear();
  }

private:
  channel() {
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (!initialised) fail("runtime::mpi::channel: MPI is not initialised");
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    int* upper = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &upper, &flag);
    const int top = flag && upper ? *upper : 32767;
    tag_failure_ = top;
    tag_query_ = top - 1;
    tag_reply_ = top - 2;
    tag_notice_ = top - 3;
  }

  struct activity {
    std::string what;
    clock::time_point since;
  };
  struct notice {
    std::string text;
    clock::time_point since;
  };
  struct pending_send {
    std::string bytes;
    MPI_Request request = MPI_REQUEST_NULL;
  };

  // This rank's answer: 'w' waiting, 'f' failed or 'r' running (between waits: a rank serves
  // only while it waits, so only a failing rank's grace says so), the seconds since, the text.
  [[nodiscard]] std::string answer() const {
    char kind = 'r';
    double secs = 0;
    std::string what;
    if (failed_) {
      kind = 'f';
      what = *failed_;
    } else if (!activities_.empty()) {
      kind = 'w';
      what = activities_.back().what;
      secs = std::chrono::duration<double>(clock::now() - activities_.back().since).count();
    }
    std::string out(1, kind);
    out.append(reinterpret_cast<const char*>(&secs), sizeof secs);
    return out + what;
  }

  // "is waiting for X" of one rank, "are waiting for X" of several; other phrases unchanged.
  [[nodiscard]] static std::string plural(const std::string& said) {
    if (said.starts_with("is ")) return "are " + said.substr(3);
    if (said.starts_with("does not ")) return "do not " + said.substr(9);
    return said;
  }

  void probe(int tag, int& flag, MPI_Status& st) const {
    flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, &flag, &st);
  }

  // The message `st` announced (it has arrived: the receive returns at once).
  [[nodiscard]] static std::string receive(const MPI_Status& st) {
    int count = 0;
    MPI_Get_count(&st, MPI_CHAR, &count);
    std::string text(static_cast<std::size_t>(std::max(count, 0)), '\0');
    MPI_Recv(text.data(), count, MPI_CHAR, st.MPI_SOURCE, st.MPI_TAG, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    return text;
  }

  void send(std::string bytes, int to, int tag) {
    auto& s = sends_.emplace_back();
    s.bytes = std::move(bytes);
    MPI_Isend(s.bytes.data(), static_cast<int>(s.bytes.size()), MPI_CHAR, to, tag, MPI_COMM_WORLD, &s.request);
  }

  void complete_sends() {
    while (!sends_.empty()) {
      int done = 0;
      MPI_Test(&sends_.front().request, &done, MPI_STATUS_IGNORE);
      if (!done) return;
      sends_.pop_front();
    }
  }

  int rank_ = 0, size_ = 1;
  int tag_failure_ = 0, tag_query_ = 0, tag_reply_ = 0, tag_notice_ = 0;
  std::int64_t queries_ = 0;
  std::vector<activity> activities_;
  std::optional<std::string> failed_; ///< this rank's failure, once run_or_abort has it
  std::map<int, notice> notices_;
  std::deque<pending_send> sends_; // a deque: an Isend's buffer must not move
};

} // namespace concerto::runtime::mpi
