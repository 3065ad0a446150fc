// tokenmix/tokenmix.hpp — umbrella header: everything public.
#pragma once

#include "tokenmix/attention.hpp"
#include "tokenmix/error.hpp"
#include "tokenmix/kv_cache.hpp"
#include "tokenmix/layer.hpp"
#include "tokenmix/rope.hpp"
#include "tokenmix/runtime.hpp"
#include "tokenmix/softmax.hpp"
#include "tokenmix/tensor.hpp"
