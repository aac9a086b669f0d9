#pragma once
/// @file
/// @brief JSON form of an ir::graph (schema "concerto.graph/1", see docs/graph-schema.md).
///
/// Writing emits every field. Reading accepts graphs written by other tools: optional fields
/// get defaults, axes and streams may be named instead of indexed, and anything malformed is
/// reported as concerto::error naming the task, buffer or field; no nlohmann exception escapes.

#include <concerto/ir/graph.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace concerto::ir {

namespace detail {

using json = nlohmann::json;

/// Appends a rendering of `v` to `out` until `out` holds `limit` characters, descending at most
/// `depth` levels: a value nested 100,000 levels deep is shown without recursing that deep.
inline void preview_into(const json& v, std::string& out, std::size_t limit, int depth) {
  if (out.size() >= limit) return;
  if (!v.is_structured()) {
    out += v.dump(-1, ' ', false, json::error_handler_t::replace);
    return;
  }
  const bool array = v.is_array();
  if (depth == 0 && !v.empty()) {
    out += array ? "[...]" : "{...}";
    return;
  }
  out += array ? '[' : '{';
  bool first = true;
  for (auto it = v.begin(); it != v.end() && out.size() < limit; ++it) {
    if (!first) out += ',';
    first = false;
    if (!array) {
      out += json(it.key()).dump(-1, ' ', false, json::error_handler_t::replace);
      out += ':';
    }
    preview_into(*it, out, limit, depth - 1);
  }
  out += array ? ']' : '}';
}

/// A short rendering of a value for messages; never throws on odd strings, never recurses deep.
inline std::string json_preview(const json& v) {
  std::string text;
  preview_into(v, text, 40, 3);
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return std::string(v.type_name()) + " " + text;
}

[[noreturn]] inline void field_error(const std::string& where, std::string_view key, std::string_view must,
                                     const json& got) {
  fail(where + ": field '" + std::string(key) + "' must be " + std::string(must) + " (got " + json_preview(got) +
       ")");
}

/// The value of `key` in `obj`, or nullptr when absent or null (null means "use the default").
inline const json* find_field(const json& obj, std::string_view key) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

inline double to_number(const json& v, const std::string& where, std::string_view key) {
  if (!v.is_number()) field_error(where, key, "a number", v);
  return v.get<double>();
}

/// An integer; integral floats (1e9) and booleans (attrs such as trans_a) are accepted.
inline std::int64_t to_integer(const json& v, const std::string& where, std::string_view key) {
  if (v.is_boolean()) return v.get<bool>() ? 1 : 0;
  if (v.is_number_integer() && !v.is_number_unsigned()) return v.get<std::int64_t>();
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      field_error(where, key, "an integer that fits in 64 bits", v);
    return static_cast<std::int64_t>(u);
  }
  if (v.is_number_float()) {
    const auto d = v.get<double>();
    // 2^63 is exactly representable; anything at or above it would overflow the cast.
    if (std::isfinite(d) && std::floor(d) == d && d >= -9.2233720368547758e18 && d < 9.2233720368547758e18)
      return static_cast<std::int64_t>(d);
  }
  field_error(where, key, "an integer", v);
}

inline int to_int(const json& v, const std::string& where, std::string_view key) {
  const auto i = to_integer(v, where, key);
  if (i < std::numeric_limits<int>::min() || i > std::numeric_limits<int>::max())
    field_error(where, key, "a 32-bit integer", v);
  return static_cast<int>(i);
}

inline double number_field(const json& obj, std::string_view key, const std::string& where, double fallback) {
  const auto* v = find_field(obj, key);
  return v ? to_number(*v, where, key) : fallback;
}

inline std::int64_t integer_field(const json& obj, std::string_view key, const std::string& where,
                                  std::int64_t fallback) {
  const auto* v = find_field(obj, key);
  return v ? to_integer(*v, where, key) : fallback;
}

inline int int_field(const json& obj, std::string_view key, const std::string& where, int fallback) {
  const auto* v = find_field(obj, key);
  return v ? to_int(*v, where, key) : fallback;
}

inline std::string string_field(const json& obj, std::string_view key, const std::string& where,
                                std::string fallback = {}) {
  const auto* v = find_field(obj, key);
  if (!v) return fallback;
  if (!v->is_string()) field_error(where, key, "a string", *v);
  return v->get<std::string>();
}

/// The array under `key`, or nullptr when absent.
inline const json* array_field(const json& obj, std::string_view key, const std::string& where) {
  const auto* v = find_field(obj, key);
  if (v && !v->is_array()) field_error(where, key, "an array", *v);
  return v;
}

inline std::vector<std::int64_t> integer_list(const json& obj, std::string_view key, const std::string& where) {
  std::vector<std::int64_t> out;
  if (const auto* arr = array_field(obj, key, where)) {
    out.reserve(arr->size());
    for (const auto& v : *arr) {
      if (v.is_boolean()) field_error(where, key, "an array of integers", *arr);
      if (!v.is_number()) field_error(where, key, "an array of integers", *arr);
      out.push_back(to_integer(v, where, key));
    }
  }
  return out;
}

inline void require_object(const json& v, const std::string& where) {
  if (!v.is_object()) fail(where + " must be a JSON object (got " + json_preview(v) + ")");
}

/// Parses an enum from its name; the message lists every valid name.
template <class Enum>
Enum enum_field(const json& obj, std::string_view key, const std::string& where, Enum fallback, int count) {
  const auto* v = find_field(obj, key);
  if (!v) return fallback;
  if (!v->is_string()) field_error(where, key, "a string", *v);
  const auto& s = v->get_ref<const std::string&>();
  std::string valid;
  for (int i = 0; i < count; ++i) {
    const auto e = static_cast<Enum>(i);
    if (to_string(e) == s) return e;
    valid += (i ? ", " : "") + std::string(to_string(e));
  }
  fail(where + ": unknown " + std::string(key) + " '" + s + "'; valid values: " + valid);
}

inline std::string task_where(const std::string& graph_where, std::int64_t id, const std::string& name) {
  return graph_where + ": task " + std::to_string(id) + " '" + name + "'";
}

/// Ids are optional; when given they must be a permutation of 0..n-1 (entries may come in any order).
inline std::vector<std::size_t> placement_by_id(const json& list, const std::string& where, std::string_view what) {
  std::vector<std::size_t> slot(list.size());
  std::vector<bool> taken(list.size(), false);
  for (std::size_t i = 0; i < list.size(); ++i) {
    const auto entry_where = where + ": " + std::string(what) + " at index " + std::to_string(i);
    require_object(list[i], entry_where);
    const auto id = integer_field(list[i], "id", entry_where, static_cast<std::int64_t>(i));
    if (id < 0 || static_cast<std::size_t>(id) >= list.size())
      fail(entry_where + ": id " + std::to_string(id) + " is out of range (ids run from 0 to " +
           std::to_string(list.size()) + " - 1)");
    if (taken[static_cast<std::size_t>(id)])
      fail(entry_where + ": id " + std::to_string(id) + " is used by two " + std::string(what) + "s");
    taken[static_cast<std::size_t>(id)] = true;
    slot[i] = static_cast<std::size_t>(id);
  }
  return slot;
}

/// Mesh axis by name or index.
inline int axis_ref(const graph& g, const json& v, const std::string& where) {
  if (v.is_string()) {
    const auto& s = v.get_ref<const std::string&>();
    if (const auto a = g.axis_index(s)) return *a;
    std::string names;
    for (const auto& ax : g.axes) names += (names.empty() ? "" : ", ") + ax.name;
    fail(where + ": field 'axis' names mesh axis '" + s + "', which does not exist (axes: " +
         (names.empty() ? "none" : names) + ")");
  }
  if (!v.is_number()) field_error(where, "axis", "a mesh axis name or index", v);
  const int a = to_int(v, where, "axis");
  if (a < -1 || a >= static_cast<int>(g.axes.size()))
    fail(where + ": field 'axis' is " + std::to_string(a) + ", but the graph has " + std::to_string(g.axes.size()) +
         " mesh axes");
  return a;
}

/// Stream by name or index.
inline stream_id stream_ref(const graph& g, const json& v, const std::string& where) {
  if (v.is_string()) {
    const auto& s = v.get_ref<const std::string&>();
    for (std::size_t i = 0; i < g.streams.size(); ++i)
      if (g.streams[i].name == s) return static_cast<stream_id>(i);
    std::string names;
    for (const auto& st : g.streams) names += (names.empty() ? "" : ", ") + st.name;
    fail(where + ": field 'stream' names stream '" + s + "', which does not exist (streams: " + names + ")");
  }
  if (!v.is_number()) field_error(where, "stream", "a stream name or index", v);
  const int s = to_int(v, where, "stream");
  if (s < 0 || s >= static_cast<int>(g.streams.size()))
    fail(where + ": field 'stream' is " + std::to_string(s) + ", but the graph has " +
         std::to_string(g.streams.size()) + " streams");
  return s;
}

inline void read_axes(graph& g, const json& doc, const std::string& where) {
  const auto* axes = array_field(doc, "axes", where);
  if (!axes) return;
  for (std::size_t i = 0; i < axes->size(); ++i) {
    const auto& a = (*axes)[i];
    const auto at = where + ": mesh axis " + std::to_string(i);
    require_object(a, at);
    mesh_axis ax;
    ax.name = string_field(a, "name", at);
    if (ax.name.empty()) fail(at + ": field 'name' is required");
    const auto named = at + " '" + ax.name + "'";
    if (g.axis_index(ax.name)) fail(named + " is listed twice");
    ax.size = int_field(a, "size", named, 1);
    if (ax.size < 1) fail(named + ": field 'size' must be at least 1 (got " + std::to_string(ax.size) + ")");
    ax.link = enum_field(a, "link", named, link_class::intra_node, 2);
    g.axes.push_back(std::move(ax));
  }
}

inline void read_streams(graph& g, const json& doc, const std::string& where) {
  const auto* streams = array_field(doc, "streams", where);
  if (!streams) { // the builder's convention: compute, then one lane per axis
    g.streams = {stream{"compute", -1}};
    for (std::size_t a = 0; a < g.axes.size(); ++a) g.streams.push_back({"comm:" + g.axes[a].name, static_cast<int>(a)});
    return;
  }
  g.streams.clear();
  for (std::size_t i = 0; i < streams->size(); ++i) {
    const auto& s = (*streams)[i];
    const auto at = where + ": stream " + std::to_string(i);
    require_object(s, at);
    stream st;
    st.name = string_field(s, "name", at);
    const auto named = at + " '" + st.name + "'";
    if (const auto* ax = find_field(s, "axis")) {
      st.axis = axis_ref(g, *ax, named);
    } else if (st.name.starts_with("comm:")) {
      const auto a = g.axis_index(std::string_view(st.name).substr(5));
      if (!a) fail(named + ": no field 'axis', and no mesh axis is called '" + st.name.substr(5) + "'");
      st.axis = *a;
    }
    if (!find_field(s, "name")) st.name = st.axis < 0 ? "compute" : "comm:" + g.axes[static_cast<std::size_t>(st.axis)].name;
    // Plans and traces name streams: two streams of one name could not be told apart.
    for (std::size_t j = 0; j < g.streams.size(); ++j)
      if (g.streams[j].name == st.name)
        fail(at + ": name '" + st.name + "' is already stream " + std::to_string(j) + "'s; stream names must differ");
    g.streams.push_back(std::move(st));
  }
  if (g.streams.empty() || !g.streams[0].is_compute())
    fail(where + ": stream 0 must be the compute stream (a stream without 'axis')");
}

inline void read_buffers(graph& g, const json& doc, const std::string& where) {
  const auto* list = array_field(doc, "buffers", where);
  if (!list) return;
  const auto slot = placement_by_id(*list, where, "buffer");
  g.buffers.assign(list->size(), buffer{});
  for (std::size_t i = 0; i < list->size(); ++i) {
    const auto& b = (*list)[i];
    buffer buf;
    buf.id = static_cast<buffer_id>(slot[i]);
    buf.name = string_field(b, "name", where + ": buffer " + std::to_string(buf.id));
    const auto at = where + ": buffer " + std::to_string(buf.id) + " '" + buf.name + "'";
    buf.type = enum_field(b, "dtype", at, dtype::f32, 5);
    buf.role = enum_field(b, "role", at, buffer_role::activation, 6);
    buf.shape = integer_list(b, "shape", at);
    std::int64_t elems = 1;
    for (const auto e : buf.shape) {
      if (e < 0) fail(at + ": field 'shape' has a negative extent (" + std::to_string(e) + ")");
      elems = e == 0 || elems <= std::numeric_limits<std::int64_t>::max() / e ? elems * e : -1;
      if (elems < 0) fail(at + ": field 'shape' describes more than 2^63 elements");
    }
    const auto derived = buf.shape.empty() ? std::int64_t{0} : elems * static_cast<std::int64_t>(size_of(buf.type));
    buf.bytes = integer_field(b, "bytes", at, derived);
    if (buf.bytes < 0) fail(at + ": field 'bytes' is negative (" + std::to_string(buf.bytes) + ")");
    buf.view_of = static_cast<buffer_id>(int_field(b, "view_of", at, -1));
    if (buf.view_of < -1 || buf.view_of >= static_cast<buffer_id>(list->size()))
      fail(at + ": field 'view_of' names buffer " + std::to_string(buf.view_of) + ", which does not exist");
    buf.offset = integer_field(b, "offset", at, 0);
    if (buf.offset < 0) fail(at + ": field 'offset' is negative (" + std::to_string(buf.offset) + ")");
    g.buffers[slot[i]] = std::move(buf);
  }
}

inline void read_tasks(graph& g, const json& doc, const std::string& where) {
  const auto* list = array_field(doc, "tasks", where);
  if (!list) return;
  const auto n = static_cast<std::int64_t>(list->size());
  const auto slot = placement_by_id(*list, where, "task");
  g.tasks.assign(list->size(), task{});
  for (std::size_t i = 0; i < list->size(); ++i) {
    const auto& j = (*list)[i];
    task t;
    t.id = static_cast<task_id>(slot[i]);
    t.name = string_field(j, "name", where + ": task " + std::to_string(t.id));
    const auto at = task_where(where, t.id, t.name);

    const auto* kind = find_field(j, "kind");
    if (!kind) fail(at + ": field 'kind' is required");
    if (!kind->is_string()) field_error(at, "kind", "a string", *kind);
    const auto parsed = op_kind_from_string(kind->get_ref<const std::string&>());
    if (!parsed) {
      std::string valid;
      for (int k = 0; k < op_kind_count; ++k) valid += (k ? ", " : "") + std::string(to_string(static_cast<op_kind>(k)));
      fail(at + ": unknown kind '" + kind->get<std::string>() + "'; valid kinds: " + valid);
    }
    t.kind = *parsed;

    t.flops = number_field(j, "flops", at, 0);
    t.bytes = number_field(j, "bytes", at, 0);
    if (t.flops < 0) fail(at + ": field 'flops' is negative (" + std::to_string(t.flops) + ")");
    if (t.bytes < 0) fail(at + ": field 'bytes' is negative (" + std::to_string(t.bytes) + ")");
    // A reducing collective without fn sums; a compute task without one is priced by its kind
    // (cost-only graphs).
    if (const auto fn = string_field(j, "fn", at); !fn.empty()) t.fn = parse_op(fn, at);
    else if (reduces(t.kind)) t.fn = op::sum;
    t.step_phase = enum_field(j, "phase", at, phase::forward, 3);
    t.layer = int_field(j, "layer", at, -1);

    if (const auto* ax = find_field(j, "axis")) t.axis = axis_ref(g, *ax, at);
    const auto* st = find_field(j, "stream");
    if (st) {
      t.stream = stream_ref(g, *st, at);
      // A collective placed on a lane may leave its axis implied by the lane.
      if (t.axis < 0 && is_collective(t.kind)) t.axis = g.streams[static_cast<std::size_t>(t.stream)].axis;
    } else if (is_collective(t.kind)) {
      if (t.axis < 0) fail(at + ": a " + std::string(to_string(t.kind)) + " needs field 'axis' (or 'stream')");
      const auto lane = g.lane_of_axis(t.axis);
      if (!lane)
        fail(at + ": mesh axis '" + g.axes[static_cast<std::size_t>(t.axis)].name +
             "' has no communication stream; list one in 'streams' or give field 'stream'");
      t.stream = *lane;
    } else {
      t.stream = compute_stream;
    }

    for (const auto d : integer_list(j, "deps", at)) {
      if (d < 0 || d >= n)
        fail(at + ": dependency " + std::to_string(d) + " does not exist (the graph has " + std::to_string(n) +
             " tasks)");
      if (d == t.id) fail(at + ": depends on itself");
      t.deps.push_back(static_cast<task_id>(d));
    }
    for (const auto* key : {"reads", "writes"}) {
      auto& out = std::string_view(key) == "reads" ? t.reads : t.writes;
      for (const auto b : integer_list(j, key, at)) {
        if (b < 0 || b >= static_cast<std::int64_t>(g.buffers.size()))
          fail(at + ": field '" + key + "' names buffer " + std::to_string(b) + ", which does not exist (the graph has " +
               std::to_string(g.buffers.size()) + " buffers)");
        out.push_back(static_cast<buffer_id>(b));
      }
    }
    if (const auto* attrs = find_field(j, "attrs")) {
      if (!attrs->is_object()) field_error(at, "attrs", "an object of integers", *attrs);
      for (const auto& [key, value] : attrs->items()) t.attrs[key] = to_integer(value, at, "attrs." + key);
    }
    g.tasks[slot[i]] = std::move(t);
  }
}

} // namespace detail

/// @brief The graph as JSON (schema "concerto.graph/1"), every field written.
/// @code
/// std::ofstream("step.graph.json") << ir::to_json(graph).dump(1);
/// @endcode
[[nodiscard]] inline nlohmann::json to_json(const graph& g) {
  using nlohmann::json;
  json axes = json::array();
  for (const auto& a : g.axes) axes.push_back({{"name", a.name}, {"size", a.size}, {"link", to_string(a.link)}});
  json streams = json::array();
  for (const auto& s : g.streams) streams.push_back({{"name", s.name}, {"axis", s.axis}});
  json buffers = json::array();
  for (const auto& b : g.buffers)
    buffers.push_back({{"id", b.id},
                       {"name", b.name},
                       {"bytes", b.bytes},
                       {"dtype", to_string(b.type)},
                       {"role", to_string(b.role)},
                       {"shape", b.shape},
                       {"view_of", b.view_of},
                       {"offset", b.offset}});
  json tasks = json::array();
  for (const auto& t : g.tasks) {
    json attrs = json::object();
    for (const auto& [k, v] : t.attrs) attrs[k] = v;
    tasks.push_back({{"id", t.id},
                     {"name", t.name},
                     {"kind", to_string(t.kind)},
                     {"stream", t.stream},
                     {"flops", t.flops},
                     {"bytes", t.bytes},
                     {"reads", t.reads},
                     {"writes", t.writes},
                     {"deps", t.deps},
                     {"fn", t.fn == op::none ? std::string_view() : to_string(t.fn)},
                     {"attrs", std::move(attrs)},
                     {"axis", t.axis},
                     {"phase", to_string(t.step_phase)},
                     {"layer", t.layer}});
  }
  return {{"schema", "concerto.graph/1"}, {"name", g.name},       {"cost_only", g.cost_only}, {"axes", std::move(axes)},
          {"streams", std::move(streams)}, {"buffers", std::move(buffers)}, {"tasks", std::move(tasks)}};
}

/// @brief Reads and validates a graph; throws concerto::error naming the offending task or field.
/// @code
/// auto g = ir::graph_from_json(nlohmann::json::parse(file));
/// @endcode
[[nodiscard]] inline graph graph_from_json(const nlohmann::json& doc) {
  std::string where = "graph JSON";
  try {
    detail::require_object(doc, where);
    const auto schema = detail::string_field(doc, "schema", where, "concerto.graph/1");
    if (schema != "concerto.graph/1")
      fail(where + ": unsupported schema '" + schema + "' (this library reads 'concerto.graph/1')");
    graph g;
    g.name = detail::string_field(doc, "name", where);
    where = "graph '" + g.name + "'";
    if (const auto* c = detail::find_field(doc, "cost_only")) {
      if (!c->is_boolean()) detail::field_error(where, "cost_only", "true or false", *c);
      g.cost_only = c->get<bool>();
    }
    detail::read_axes(g, doc, where);
    detail::read_streams(g, doc, where);
    detail::read_buffers(g, doc, where);
    detail::read_tasks(g, doc, where);
    g.validate(); // cycles, views outside their root, kinds on the wrong stream
    return g;
  } catch (const nlohmann::json::exception& e) { // a safety net: the readers check types first
    fail(where + ": " + e.what());
  }
}

/// @brief Parses JSON text and reads a graph; a syntax error reports the parser's line and column.
[[nodiscard]] inline graph graph_from_json_text(std::string_view text) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::parse_error& e) {
    fail("graph JSON: syntax error at byte " + std::to_string(e.byte) + ": " + e.what());
  } catch (const nlohmann::json::exception& e) { // e.g. a number past a double's range (1e400)
    fail(std::string("graph JSON: cannot be read: ") + e.what());
  }
  return graph_from_json(doc);
}

} // namespace concerto::ir
