#pragma once
// Everything a call writes to the process's stderr (file descriptor 2, so that fprintf from the
// library is caught too), for tests of progress and warning messages.
#include <catch2/catch_test_macros.hpp>

#include <cstdio>
#include <string>

#include <unistd.h>

namespace unit_testing {

template <class F>
std::string stderr_of(F&& run) {
  std::fflush(stderr);
  std::FILE* sink = std::tmpfile();
  REQUIRE(sink);
  const int saved = ::dup(2);
  ::dup2(::fileno(sink), 2);
  run();
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  std::string out;
  std::rewind(sink);
  for (int ch; (ch = std::fgetc(sink)) != EOF;) out += static_cast<char>(ch);
  std::fclose(sink);
  return out;
}

} // namespace unit_testing
