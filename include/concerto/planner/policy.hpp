#pragma once
/// @file
/// @brief The plan policies: how make_plan orders a graph. A closed set, so a type: the names
/// appear here once, for JSON, flags and messages, and every other layer switches over the enum.
///
/// | policy | family | what it is |
/// |---|---|---|
/// | `sync` | list | every collective waits for the compute before it and holds the compute after it |
/// | `program_order` | list | each stream runs its tasks in program order, collectives overlap |
/// | `xla_lhs` | list | XLA's latency-hiding scheduler: collectives started early, a cap on those in flight |
/// | `megatron`, `megatron_tp_overlap`, `deepspeed` | framework | the framework's recipe (planner/frameworks.hpp) |
/// | `concerto` | search | rewrites, then the solver from the best of the above (planner/make_plan.hpp) |
///
/// @code
/// auto p = planner::make_plan(g, model, {.policy = planner::policy::xla_lhs});
/// const auto from_flag = planner::parse_policy(argv[1], "--policy");   // throws listing the names
/// std::printf("%s\n", std::string(planner::to_string(from_flag)).c_str());
/// @endcode

#include <concerto/core/error.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::planner {

/// @brief A plan policy (the table below says what each is).
enum class policy : std::uint8_t { sync, program_order, xla_lhs, megatron, megatron_tp_overlap, deepspeed, concerto };

/// @brief How a policy makes its plan.
enum class policy_family : std::uint8_t {
  list,      ///< a list scheduler over the graph as given (planner/list.hpp)
  framework, ///< a framework's recipe: its buckets and its synchronous edges (planner/frameworks.hpp)
  search,    ///< concerto's rewrites and solver
};

struct policy_info {
  policy id;
  std::string_view name;
  policy_family family;
};

/// @brief Every policy, in the order reports list them (the enum's).
inline constexpr std::array<policy_info, 7> policy_table{{
    {policy::sync, "sync", policy_family::list},
    {policy::program_order, "program_order", policy_family::list},
    {policy::xla_lhs, "xla_lhs", policy_family::list},
    {policy::megatron, "megatron", policy_family::framework},
    {policy::megatron_tp_overlap, "megatron_tp_overlap", policy_family::framework},
    {policy::deepspeed, "deepspeed", policy_family::framework},
    {policy::concerto, "concerto", policy_family::search},
}};

namespace detail {
constexpr bool policy_table_in_order() {
  for (std::size_t i = 0; i < policy_table.size(); ++i)
    if (static_cast<std::size_t>(policy_table[i].id) != i) return false;
  return true;
}
static_assert(policy_table_in_order(), "planner::policy and planner::policy_table list the policies in different orders");
} // namespace detail

[[nodiscard]] constexpr const policy_info& info(policy p) noexcept { return policy_table[static_cast<std::size_t>(p)]; }
[[nodiscard]] constexpr std::string_view to_string(policy p) noexcept { return info(p).name; }
[[nodiscard]] constexpr policy_family family(policy p) noexcept { return info(p).family; }

/// @brief The policy of a name, or nullopt.
[[nodiscard]] constexpr std::optional<policy> policy_from_string(std::string_view name) noexcept {
  for (const auto& p : policy_table)
    if (p.name == name) return p.id;
  return std::nullopt;
}

/// @brief The policies of a family, in table order.
[[nodiscard]] inline std::vector<policy> policies_of(policy_family f) {
  std::vector<policy> out;
  for (const auto& p : policy_table)
    if (p.family == f) out.push_back(p.id);
  return out;
}

/// @brief Every policy's name, comma-separated, for messages and --help.
[[nodiscard]] inline std::string policy_list() {
  std::string out;
  for (const auto& p : policy_table) out.append(out.empty() ? "" : ", ").append(p.name);
  return out;
}

/// @brief The policy named `name`; throws concerto::error naming `where` (a flag, a JSON field)
/// and listing the policies when there is none.
[[nodiscard]] inline policy parse_policy(std::string_view name, std::string_view where) {
  if (const auto p = policy_from_string(name)) return *p;
  fail(std::string(where) + ": '" + std::string(name) + "' is not a plan policy (" + policy_list() + ")");
}

} // namespace concerto::planner
