// concerto::write_file_atomically: the content arrives whole, and the temporaries of a writer
// killed mid-write are removed by the next write of the same path, but not those of live writers
// or other hosts.
#include <concerto/core/file.hpp>

#include <catch2/catch_test_macros.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include <sys/wait.h>
#include <unistd.h>

using namespace concerto;
namespace fs = std::filesystem;

namespace {

std::string content_of(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::set<std::string> names_in(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

/// The pid of a process that has exited and been reaped.
pid_t dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  return child;
}

} // namespace

TEST_CASE("a write leaves the whole content and no temporary file", "[file]") {
  const auto dir = fs::temp_directory_path() / ("concerto-file-test-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  write_file_atomically(dir / "sub" / "a.txt", "first");
  write_file_atomically(dir / "sub" / "a.txt", "second");
  CHECK(content_of(dir / "sub" / "a.txt") == "second");
  CHECK(names_in(dir / "sub") == std::set<std::string>{"a.txt"});
  fs::remove_all(dir);
}

TEST_CASE("the temporaries of a writer killed mid-write are removed by the next write", "[file]") {
  const auto dir = fs::temp_directory_path() / ("concerto-file-test-abandoned-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto touch = [&](const std::string& name) { std::ofstream(dir / name) << "partial"; };
  const auto host = host_name();
  const auto abandoned = "model.ckpt.tmp." + std::to_string(dead_pid()) + "-123." + host;
  const auto live = "model.ckpt.tmp." + std::to_string(::getpid()) + "-456." + host;
  const auto elsewhere = "model.ckpt.tmp." + std::to_string(dead_pid()) + "-789.another-host-" + host;
  const auto other_target = "other.ckpt.tmp." + std::to_string(dead_pid()) + "-1." + host;
  const auto unrecognised = "model.ckpt.tmp.12345";
  for (const auto& name : {abandoned, live, elsewhere, other_target, std::string(unrecognised)}) touch(name);

  write_file_atomically(dir / "model.ckpt", "whole");

  CHECK(content_of(dir / "model.ckpt") == "whole");
  CHECK(names_in(dir) == std::set<std::string>{"model.ckpt", live, elsewhere, other_target, unrecognised});
  fs::remove_all(dir);
}
