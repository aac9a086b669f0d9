#pragma once
/// @file
/// @brief Rank 0 decides, every rank gets the decision or the same error.
///
/// Planning, the plan choice's verdict, the pipeline schedule, the kernel factors kept on disk:
/// one rank computes, the others need its answer. The decision travels as one JSON document,
/// `{"value": ...}` or `{"error": "<rank 0's message>"}`, so that a failure on rank 0 becomes the
/// same concerto::collective_error on every rank (printed once, runtime/mpi/environment.hpp)
/// instead of leaving the others in the broadcast, and no payload needs a marker of its own.
///
/// @code
/// const auto schedule = runtime::decide_on_rank_0(control, "the pipeline schedule from rank 0",
///                                                 "choosing the pipeline schedule failed on rank 0",
///                                                 [&] { return nlohmann::json(choose(problem)); });
/// @endcode

#include <concerto/core/error.hpp>

#include <nlohmann/json.hpp>

#include <concepts>
#include <exception>
#include <string>
#include <string_view>

namespace concerto::runtime {

/// @brief What carries a decision: rank(), and broadcast(bytes, root, what) with a deadline
/// (runtime::mpi::control, and both backends).
template <class C>
concept decision_carrier = requires(C& c, std::string& bytes) {
  { c.rank() } -> std::convertible_to<int>;
  c.broadcast(bytes, 0, std::string_view());
};

/// @brief Rank 0 calls `decide` (returning nlohmann::json); every rank returns what it returned.
/// When it throws, every rank throws concerto::collective_error "<failure>: <rank 0's message>".
/// `what` names the broadcast in a timeout. Collective.
template <decision_carrier C, class Decide>
[[nodiscard]] nlohmann::json decide_on_rank_0(C& carrier, std::string_view what, std::string_view failure, Decide&& decide) {
  std::string text;
  if (carrier.rank() == 0) {
    nlohmann::json envelope;
    try {
      envelope["value"] = decide();
    } catch (const std::exception& e) {
      std::string message = e.what();
      if (message.starts_with("concerto: ")) message.erase(0, 10);
      envelope = nlohmann::json{{"error", message}};
    }
    text = envelope.dump();
  }
  carrier.broadcast(text, 0, what);
  auto envelope = nlohmann::json::parse(text);
  if (const auto error = envelope.find("error"); error != envelope.end())
    fail_on_every_rank(std::string(failure) + ": " + error->get<std::string>());
  return std::move(envelope.at("value"));
}

} // namespace concerto::runtime
