#pragma once
/// @file
/// @brief The plan cache's payload: a compact binary form of a plan::plan and the key it was
/// stored under, read back with every length, index and enum checked.
///
/// Why not JSON: on a 4,000-task plan nlohmann's DOM parse plus plan_from_json take about
/// 50 ms, which alone misses the 50 ms hit target; nlohmann's CBOR and MessagePack readers
/// build the same DOM and are slower still. Reading fixed-width fields straight into the plan's
/// vectors takes a few milliseconds (docs/plan-cache.md has the measurements).
///
/// Layout (all integers and doubles in the writer's byte order, which the first word
/// records; strings are a u32 length and the bytes; lists a u32 count and the items):
///
///     u32 0x01020304 (byte order) | key: u64 graph, u64 mesh, u64 cost_model, str backend,
///     str library_version, str policy, u64 options | u64 plan graph hash | str policy,
///     str preset, f64 plan_seconds, f64 lower_bound_us, i32 windows_total, i32 windows_optimal |
///     graph: str name, u8 cost_only, [axis: str name, i32 size, u8 link], [stream: str name, i32 axis],
///     [buffer: str name, i64 bytes, u8 dtype, u8 role, [i64 extent], i32 view_of, i64 offset],
///     [task: str name, u8 kind, i32 stream, f64 flops, f64 bytes, [i32 read], [i32 write],
///     [i32 dep], str fn, [str key, i64 value], i32 axis, u8 phase, i32 layer] |
///     per stream [i32 task] | per task f64 start_us | per task f64 duration_us
///
/// The format's version is the cache file's (cache::format_version); change both together.

#include <concerto/cache/key.hpp>
#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/plan/plan.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace concerto::cache::detail {

/// What a payload holds: the key it was stored under, the plan's graph hash as the writing
/// library computed it, and the plan.
struct document {
  cache_key key;
  std::uint64_t plan_graph = 0;
  plan::plan plan;
};

inline constexpr std::uint32_t byte_order_mark = 0x01020304u;

class writer {
public:
  template <class T> void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &v, sizeof(T));
  }
  void put(std::string_view s) {
    put(static_cast<std::uint32_t>(s.size()));
    out_.append(s);
  }
  template <class T> void put_list(const std::vector<T>& v) {
    put(static_cast<std::uint32_t>(v.size()));
    const auto at = out_.size();
    out_.resize(at + v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(out_.data() + at, v.data(), v.size() * sizeof(T));
  }
  template <class T> void put_raw(const std::vector<T>& v) {
    const auto at = out_.size();
    out_.resize(at + v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(out_.data() + at, v.data(), v.size() * sizeof(T));
  }
  std::string take() && { return std::move(out_); }

private:
  std::string out_;
};

/// Reads with bounds checks; every failure names the byte offset and what was being read.
class reader {
public:
  explicit reader(std::string_view in) : in_(in) {}

  template <class T> T get(const char* what) {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  std::string str(const char* what) {
    const auto n = get<std::uint32_t>(what);
    need(n, what);
    std::string s(in_.substr(at_, n));
    at_ += n;
    return s;
  }
  /// A count of items of at least `min_item` bytes each: refused when the rest cannot hold
  /// them, so a corrupt count never allocates gigabytes.
  std::size_t count(std::size_t min_item, const char* what) {
    const auto n = get<std::uint32_t>(what);
    if (min_item > 0 && n > (in_.size() - at_) / min_item) bad(std::string(what) + " count " + std::to_string(n) + " exceeds the payload");
    return n;
  }
  template <class T> void list(std::vector<T>& v, const char* what) { raw(v, count(sizeof(T), what), what); }
  template <class T> void raw(std::vector<T>& v, std::size_t n, const char* what) {
    need(n * sizeof(T), what);
    v.resize(n);
    if (n) std::memcpy(v.data(), in_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
  }
  template <class E> E enumerated(int count, const char* what) {
    const auto v = get<std::uint8_t>(what);
    if (v >= count) bad(std::string(what) + " " + std::to_string(v) + " is out of range");
    return static_cast<E>(v);
  }
  [[nodiscard]] bool at_end() const noexcept { return at_ == in_.size(); }
  [[nodiscard]] std::size_t offset() const noexcept { return at_; }
  [[noreturn]] void bad(const std::string& why) const { fail(why + " (at payload byte " + std::to_string(at_) + ")"); }

private:
  void need(std::size_t n, const char* what) const {
    if (n > in_.size() - at_) bad(std::string("the payload ends inside ") + what);
  }
  std::string_view in_;
  std::size_t at_ = 0;
};

/// The payload bytes of a document.
[[nodiscard]] inline std::string to_binary(const document& d) {
  writer w;
  w.put(byte_order_mark);
  w.put(d.key.graph);
  w.put(d.key.mesh);
  w.put(d.key.cost_model);
  w.put(std::string_view(d.key.backend));
  w.put(std::string_view(d.key.library_version));
  w.put(std::string_view(d.key.policy));
  w.put(d.key.options);
  w.put(d.plan_graph);
  const auto& p = d.plan;
  w.put(std::string_view(p.policy));
  w.put(std::string_view(p.preset));
  w.put(p.stats.plan_seconds);
  w.put(p.stats.lower_bound_us);
  w.put(static_cast<std::int32_t>(p.stats.windows_total));
  w.put(static_cast<std::int32_t>(p.stats.windows_optimal));
  const auto& g = p.graph;
  w.put(std::string_view(g.name));
  w.put(static_cast<std::uint8_t>(g.cost_only));
  w.put(static_cast<std::uint32_t>(g.axes.size()));
  for (const auto& a : g.axes) {
    w.put(std::string_view(a.name));
    w.put(static_cast<std::int32_t>(a.size));
    w.put(static_cast<std::uint8_t>(a.link));
  }
  w.put(static_cast<std::uint32_t>(g.streams.size()));
  for (const auto& s : g.streams) {
    w.put(std::string_view(s.name));
    w.put(static_cast<std::int32_t>(s.axis));
  }
  w.put(static_cast<std::uint32_t>(g.buffers.size()));
  for (const auto& b : g.buffers) {
    w.put(std::string_view(b.name));
    w.put(b.bytes);
    w.put(static_cast<std::uint8_t>(b.type));
    w.put(static_cast<std::uint8_t>(b.role));
    w.put_list(b.shape);
    w.put(b.view_of);
    w.put(b.offset);
  }
  w.put(static_cast<std::uint32_t>(g.tasks.size()));
  for (const auto& t : g.tasks) {
    w.put(std::string_view(t.name));
    w.put(static_cast<std::uint8_t>(t.kind));
    w.put(t.stream);
    w.put(t.flops);
    w.put(t.bytes);
    w.put_list(t.reads);
    w.put_list(t.writes);
    w.put_list(t.deps);
    w.put(ir::to_string(t.fn));
    w.put(static_cast<std::uint32_t>(t.attrs.size()));
    for (const auto& [k, v] : t.attrs) {
      w.put(std::string_view(k));
      w.put(v);
    }
    w.put(static_cast<std::int32_t>(t.axis));
    w.put(static_cast<std::uint8_t>(t.step_phase));
    w.put(static_cast<std::int32_t>(t.layer));
  }
  CONCERTO_CHECK(p.order.size() == g.streams.size(), "plan cache: the plan has " + std::to_string(p.order.size()) +
                                                         " stream orders for " + std::to_string(g.streams.size()) +
                                                         " streams");
  CONCERTO_CHECK(p.start_us.size() == g.tasks.size() && p.duration_us.size() == g.tasks.size(),
                 "plan cache: the plan's start and duration lists do not have one entry per task");
  for (const auto& o : p.order) w.put_list(o);
  w.put_raw(p.start_us);
  w.put_raw(p.duration_us);
  return std::move(w).take();
}

/// Reads a payload; throws concerto::error saying what is wrong and where. The graph is
/// validated; whether the schedule is sound is left to plan::verify.
[[nodiscard]] inline document from_binary(std::string_view bytes) {
  reader r(bytes);
  if (r.get<std::uint32_t>("the byte-order mark") != byte_order_mark)
    r.bad("the byte-order mark is wrong (written on a machine of another byte order, or not a plan payload)");
  document d;
  d.key.graph = r.get<std::uint64_t>("key.graph");
  d.key.mesh = r.get<std::uint64_t>("key.mesh");
  d.key.cost_model = r.get<std::uint64_t>("key.cost_model");
  d.key.backend = r.str("key.backend");
  d.key.library_version = r.str("key.library_version");
  d.key.policy = r.str("key.policy");
  d.key.options = r.get<std::uint64_t>("key.options");
  d.plan_graph = r.get<std::uint64_t>("the plan graph hash");
  auto& p = d.plan;
  p.policy = r.str("policy");
  p.preset = r.str("preset");
  p.stats.plan_seconds = r.get<double>("stats.plan_seconds");
  p.stats.lower_bound_us = r.get<double>("stats.lower_bound_us");
  p.stats.windows_total = r.get<std::int32_t>("stats.windows_total");
  p.stats.windows_optimal = r.get<std::int32_t>("stats.windows_optimal");
  auto& g = p.graph;
  g.name = r.str("graph name");
  g.cost_only = r.get<std::uint8_t>("graph cost_only") != 0;
  g.axes.resize(r.count(9, "mesh axis"));
  for (auto& a : g.axes) {
    a.name = r.str("mesh axis name");
    a.size = r.get<std::int32_t>("mesh axis size");
    a.link = r.enumerated<ir::link_class>(2, "mesh axis link class");
  }
  g.streams.resize(r.count(8, "stream"));
  for (auto& s : g.streams) {
    s.name = r.str("stream name");
    s.axis = r.get<std::int32_t>("stream axis");
  }
  g.buffers.resize(r.count(30, "buffer"));
  for (std::size_t i = 0; i < g.buffers.size(); ++i) {
    auto& b = g.buffers[i];
    b.id = static_cast<ir::buffer_id>(i);
    b.name = r.str("buffer name");
    b.bytes = r.get<std::int64_t>("buffer bytes");
    b.type = r.enumerated<ir::dtype>(5, "buffer dtype");
    b.role = r.enumerated<ir::buffer_role>(6, "buffer role");
    r.list(b.shape, "buffer shape");
    b.view_of = r.get<ir::buffer_id>("buffer view_of");
    b.offset = r.get<std::int64_t>("buffer offset");
  }
  g.tasks.resize(r.count(50, "task"));
  for (std::size_t i = 0; i < g.tasks.size(); ++i) {
    auto& t = g.tasks[i];
    t.id = static_cast<ir::task_id>(i);
    t.name = r.str("task name");
    t.kind = r.enumerated<ir::op_kind>(ir::op_kind_count, "task kind");
    t.stream = r.get<ir::stream_id>("task stream");
    t.flops = r.get<double>("task flops");
    t.bytes = r.get<double>("task bytes");
    r.list(t.reads, "task reads");
    r.list(t.writes, "task writes");
    r.list(t.deps, "task deps");
    const auto fn = r.str("task fn");
    const auto op = ir::op_from_string(fn);
    if (!op) r.bad("task fn '" + fn + "' is no op of this library");
    t.fn = *op;
    const auto attrs = r.count(12, "task attribute");
    for (std::size_t a = 0; a < attrs; ++a) {
      auto key = r.str("task attribute name");
      const auto value = r.get<std::int64_t>("task attribute value");
      // Written in map order, so each goes at the end; a repeated or unordered key is corrupt.
      if (!t.attrs.empty() && !(t.attrs.rbegin()->first < key))
        r.bad("task " + std::to_string(i) + " '" + t.name + "': attribute '" + key + "' is out of order");
      t.attrs.emplace_hint(t.attrs.end(), std::move(key), value);
    }
    t.axis = r.get<std::int32_t>("task axis");
    t.step_phase = r.enumerated<ir::phase>(3, "task phase");
    t.layer = r.get<std::int32_t>("task layer");
  }
  p.order.resize(g.streams.size());
  const auto n = g.tasks.size();
  for (std::size_t s = 0; s < p.order.size(); ++s) {
    r.list(p.order[s], "stream order");
    for (auto id : p.order[s])
      if (id < 0 || static_cast<std::size_t>(id) >= n)
        r.bad("stream '" + g.streams[s].name + "': the order names task " + std::to_string(id) +
              ", which is not in the graph");
  }
  r.raw(p.start_us, n, "start times");
  r.raw(p.duration_us, n, "durations");
  if (!r.at_end()) r.bad("bytes follow the plan");
  g.validate();
  return d;
}

} // namespace concerto::cache::detail
