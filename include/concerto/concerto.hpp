#pragma once
/// @file
/// @brief Everything: include this and `using namespace concerto;`.

#include <concerto/core/error.hpp>
#include <concerto/core/fixed_string.hpp>
#include <concerto/core/hash.hpp>
#include <concerto/expr/expr.hpp>
#include <concerto/expr/ops.hpp>
#include <concerto/expr/rules.hpp>
#include <concerto/graph/lower.hpp>
#include <concerto/graph/optimizer.hpp>
#include <concerto/graph/program.hpp>
#include <concerto/ir/builder.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/mesh/axis.hpp>
#include <concerto/mesh/mesh.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/spec/redistribute.hpp>
#include <concerto/spec/spec.hpp>
