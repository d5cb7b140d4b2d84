// Host planner of the AscendC grouped LoRA expert kernel: from the sizes and the group sizes
// (tokens_per_expert, known on the host in this op's contract) to the tiling buffers of the
// kernel launches. No torch and no CANN here, so the same code runs in the torch_npu binding, in
// the host emulation (csrc/ascendc/emu) and in the planner's unit tests.
//
// What the planner decides, per launch:
//   * the problems it runs (forward: h, then y; backward: dh and dB, then dx and dA);
//   * per problem the cube tile (baseM x baseN, Mmad K step baseK, L1 K staging kL1) and the vector
//     epilogue chunk (epiRows), each chosen inside a fixed per-buffer budget of L1/L0A/L0B/L0C/UB so
//     that any combination of problems fits one TPipe layout;
//   * the tile list: every (problem, expert, row block, column block), including zero tiles (experts
//     without rows in dA/dB, written as zeros by the vector units);
//   * which AI Core runs which tiles: longest-processing-time-first over a cost model, so one
//     dominant expert's reduction tiles (dA, dB) do not leave the other cores idle.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "lora_tiling_data.h"

namespace slmoe_ascend {

// Memory of one AI Core and the number of AI Cores (Atlas A2/A3: 910B, 910_93; dav-c220).
struct HwCaps {
  uint32_t numAic = 24;                // AI Cores (cube units); each drives two vector units
  uint32_t l1Bytes = 512 * 1024;
  uint32_t l0aBytes = 64 * 1024;
  uint32_t l0bBytes = 64 * 1024;
  uint32_t l0cBytes = 128 * 1024;
  uint32_t ubBytes = 192 * 1024;       // per vector unit
};

// Sizes of one op call: T rows, E experts, d_in -> d_out, rank r, s = alpha / r.
struct LoraDims {
  int64_t T = 0, E = 0, d_in = 0, d_out = 0, r = 0;
  double scaling = 1.0;
};

// Buffer budgets (bytes) each problem's tiles must fit, whatever else runs in the same launch.
struct Budgets {
  uint32_t a1, b1, a2, b2, c1, ub;
};
Budgets budgets_for(const HwCaps& caps);

struct LaunchPlan {
  std::string name;                  // "fwd_h", "fwd_y", "bwd_dh_db", "bwd_dx_da"
  std::vector<uint8_t> tiling;       // the bytes the kernel reads (lora_tiling_data.h)
  uint32_t blockDim = 0;             // AI Cores to launch; 0: nothing to run
  uint64_t workspaceBytes = 0;       // fp32 workspace the launch needs
  std::vector<double> coreCost;      // planned cost per core (cost model below), for tests and logs
};

// Launches of the forward: h = lora_x A^T, then y = x W^T + s h B^T. Launches with nothing to do
// (no rows) have blockDim 0. counts: E group sizes, non-negative, summing to T (checked by caller).
std::vector<LaunchPlan> plan_forward(const LoraDims& d, const int64_t* counts, const HwCaps& caps);

// Launches of the backward for the requested outputs: dh = s dy B and dB = s dy^T h, then
// dx = dy W + (dh A) [* mask] and dA = dh^T lora_x. need_dh must hold when dx or dA is requested.
std::vector<LaunchPlan> plan_backward(const LoraDims& d, const int64_t* counts, bool has_mask, bool need_dx,
                                      bool need_da, bool need_db, const HwCaps& caps);

// Cost the scheduler balances, in arbitrary units: cube multiply-adds plus a per-element epilogue
// charge and a fixed per-tile overhead. Exposed so tests can check the balance against it.
double tile_cost(const ProblemDesc& p, const TileRec& t, const int64_t* counts);

// Views of a plan's tiling bytes (no copies).
const KernelTiling& tiling_header(const LaunchPlan& plan);
const uint32_t* tiling_core_begin(const LaunchPlan& plan);
const TileRec* tiling_tiles(const LaunchPlan& plan);
const uint64_t* tiling_row_offsets(const LaunchPlan& plan);

// Extent of expert e in problem p: rows M_e, and K of term t.
uint32_t problem_rows(const ProblemDesc& p, const int64_t* counts, uint32_t e);
uint32_t term_k(const TermDesc& t, const int64_t* counts, uint32_t e);

}  // namespace slmoe_ascend
