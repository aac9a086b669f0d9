#pragma once
/// @file
/// @brief The library's exception type and the check macros that throw it.

#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>

namespace concerto {

/// @brief Every run-time error concerto reports: a message that names the problem.
///
/// @code
/// try { auto g = ir::graph_from_json(text); }
/// catch (const concerto::error& e) { std::cerr << e.what() << '\n'; }
/// @endcode
class error : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

/// @brief An error that every rank of the job raises at the same point with the same message
/// (a failed agreement check, a non-finite loss): runtime::mpi::run_or_abort prints it once.
class collective_error : public error {
public:
  using error::error;
};

/// @brief Throws concerto::error with "concerto: <message>" and, for internal checks, the location.
[[noreturn]] inline void fail(std::string_view message) {
  throw error("concerto: " + std::string(message));
}

/// @brief Throws concerto::collective_error; only where every rank is known to throw it alike.
[[noreturn]] inline void fail_on_every_rank(std::string_view message) {
  throw collective_error("concerto: " + std::string(message));
}

namespace detail {
[[noreturn]] inline void check_failed(std::string_view condition, std::string_view message,
                                      std::source_location where) {
  throw error("concerto: " + std::string(message) + " [check `" + std::string(condition) +
              "` failed at " + where.file_name() + ":" + std::to_string(where.line()) + "]");
}
} // namespace detail

} // namespace concerto

/// Checks a condition that bad input can break; throws concerto::error with the message
/// (a std::string expression) and the file:line of the check.
#define CONCERTO_CHECK(cond, message)                                                          \
  do {                                                                                         \
    if (!(cond)) [[unlikely]]                                                                  \
      ::concerto::detail::check_failed(#cond, (message), std::source_location::current());     \
  } while (false)
