#pragma once
// The training tests check the Llama example's own model.
#include "../../examples/llama/model.hpp"

namespace llama_testing = llama_model;
