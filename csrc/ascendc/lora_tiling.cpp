// Host planner of the AscendC grouped LoRA expert kernel (see lora_tiling.h).
#include "lora_tiling.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <queue>
#include <stdexcept>
#include <utility>

#ifndef SLMOE_MUTANT  // csrc/ascendc/emu selects injected bugs with this; never set in real builds
#define SLMOE_MUTANT(n) false
#endif

namespace slmoe_ascend {

static_assert(sizeof(OperandDesc) == 24 && sizeof(TermDesc) == 88 && sizeof(ProblemDesc) == 240,
              "tiling structs must keep their layout: the kernel reads the same bytes");
static_assert(sizeof(TileRec) == 16 && sizeof(KernelTiling) == 80 + kMaxProblems * sizeof(ProblemDesc),
              "tiling structs must keep their layout: the kernel reads the same bytes");

namespace {

constexpr uint32_t kC0 = 16;              // b16 elements per 32-byte block; the cube fractal is 16 x 16
constexpr uint32_t kElemBytes = 2;        // bf16 / fp16 operands
constexpr uint32_t kMaxBaseK = 128;
constexpr uint32_t kMaxKL1 = 512;
constexpr uint32_t kMaxBaseMNarrow = 256;  // N <= 32: tall, narrow tiles (h, dh, dB)
constexpr uint32_t kMaxBaseM = 128;
constexpr uint32_t kMaxBaseN = 128;

uint32_t align16(uint64_t v) { return static_cast<uint32_t>((v + kC0 - 1) / kC0 * kC0); }

OperandDesc none() { return OperandDesc{kNoTensor, kLayoutRowMajor, 0, 0, 0}; }
OperandDesc grouped(uint32_t tensor, uint32_t layout, int64_t ld) {
  return OperandDesc{tensor, layout, 1, static_cast<uint32_t>(ld), 0};
}
OperandDesc per_expert(uint32_t tensor, uint32_t layout, int64_t ld, int64_t expert_stride) {
  return OperandDesc{tensor, layout, 0, static_cast<uint32_t>(ld), static_cast<uint64_t>(expert_stride)};
}

TermDesc term(OperandDesc a, OperandDesc b, int64_t k_fixed, bool k_grouped, double scale) {
  TermDesc t{};
  t.a = a;
  t.b = b;
  t.mask = none();
  t.kFixed = k_grouped ? 0 : static_cast<uint32_t>(k_fixed);
  t.kGrouped = k_grouped ? 1 : 0;
  t.scale = static_cast<float>(scale);
  return t;
}

// A problem before tiling: the math, not yet the tile sizes.
ProblemDesc problem(std::vector<TermDesc> terms, OperandDesc c, bool m_grouped, int64_t m_fixed, int64_t n) {
  ProblemDesc p{};
  p.numTerms = static_cast<uint32_t>(terms.size());
  for (size_t i = 0; i < terms.size(); ++i) p.terms[i] = terms[i];
  p.c = c;
  p.mGrouped = m_grouped ? 1 : 0;
  p.mFixed = m_grouped ? 0 : static_cast<uint32_t>(m_fixed);
  p.n = static_cast<uint32_t>(n);
  return p;
}

bool has_mask(const ProblemDesc& p) {
  for (uint32_t t = 0; t < p.numTerms; ++t)
    if (p.terms[t].mask.tensor != kNoTensor) return true;
  return false;
}

uint64_t max_count(const int64_t* counts, int64_t E) {
  int64_t m = 0;
  for (int64_t e = 0; e < E; ++e) m = std::max(m, counts[e]);
  return static_cast<uint64_t>(m);
}

// Cube tile of one problem inside the per-buffer budgets. The vector chunk (epiRows) is chosen
// per launch afterwards, because all problems of a launch share one UB layout.
void choose_cube_tile(ProblemDesc& p, const int64_t* counts, int64_t E, const Budgets& b, uint32_t num_cores) {
  const uint64_t rows_max = p.mGrouped ? max_count(counts, E) : p.mFixed;
  uint64_t k_max = 0;
  for (uint32_t t = 0; t < p.numTerms; ++t)
    k_max = std::max<uint64_t>(k_max, p.terms[t].kGrouped ? max_count(counts, E) : p.terms[t].kFixed);
  const uint32_t n_pad = align16(std::max<uint32_t>(p.n, 1));
  // Largest tiles whose smallest K step (16) still fits: N first (wide outputs), then M.
  p.baseN = std::min(n_pad, kMaxBaseN);
  while (p.baseN > kC0 && (kC0 * p.baseN * 4 > b.c1 || kC0 * p.baseN * kElemBytes > std::min(b.b2, b.b1)))
    p.baseN -= kC0;
  uint32_t m_cap = p.baseN <= 32 ? kMaxBaseMNarrow : kMaxBaseM;
  p.baseM = std::min(align16(std::max<uint64_t>(rows_max, 1)), m_cap);
  while (p.baseM > kC0 && (p.baseM * p.baseN * 4 > b.c1 || p.baseM * kC0 * kElemBytes > std::min(b.a2, b.a1)))
    p.baseM -= kC0;
  // A per-expert output (dA, dB) reduces over the expert's rows: one dominant expert can carry most
  // of the work in a few tiles. Split its output finer until it alone can occupy every core.
  if (!p.mGrouped) {
    auto tiles = [&] { return CeilDivU32(std::max<uint32_t>(p.mFixed, 1), p.baseM) * CeilDivU32(std::max<uint32_t>(p.n, 1), p.baseN); };
    while (tiles() < num_cores && (p.baseM > kC0 || p.baseN > kC0)) {
      uint32_t& side = p.baseM >= p.baseN ? p.baseM : p.baseN;
      side = std::max(kC0, side / 2 / kC0 * kC0);
    }
  }
  const uint32_t k_pad = align16(std::max<uint64_t>(k_max, 1));
  p.baseK = std::min(kMaxBaseK, k_pad);
  while (p.baseK > kC0 && (p.baseM * p.baseK * kElemBytes > b.a2 || p.baseK * p.baseN * kElemBytes > b.b2))
    p.baseK -= kC0;
  const uint32_t k_steps = (k_pad + p.baseK - 1) / p.baseK;
  p.kL1 = p.baseK * std::min<uint32_t>(k_steps, kMaxKL1 / p.baseK);
  while (p.kL1 > p.baseK && (p.baseM * p.kL1 * kElemBytes > b.a1 || p.kL1 * p.baseN * kElemBytes > b.b1))
    p.kL1 -= p.baseK;
  if (p.baseM * p.baseK * kElemBytes > b.a2 || p.baseK * p.baseN * kElemBytes > b.b2 ||
      p.baseM * p.baseN * 4 > b.c1 || p.baseM * p.kL1 * kElemBytes > b.a1 || p.kL1 * p.baseN * kElemBytes > b.b1) {
    throw std::invalid_argument("slmoe ascend tiling: the hardware buffers are too small for a 16x16x16 tile");
  }
  if (SLMOE_MUTANT(16)) p.baseN *= 2;  // mutant 16: a tile past the budgets (only the emulation can tell)
}

// UB bytes one epilogue row needs, for the widest of the launch's problems.
struct UbRow {
  uint32_t acc = 0, mask = 0, mask_f32 = 0, out = 0;
  uint32_t total() const { return 2 * acc + 2 * mask + mask_f32 + 2 * out; }
};

void assign_tiles(LaunchPlan& plan, std::vector<ProblemDesc>& problems, const int64_t* counts, int64_t E,
                  const HwCaps& caps) {
  std::vector<TileRec> tiles;
  std::vector<double> cost;
  for (uint32_t pi = 0; pi < problems.size(); ++pi) {
    const ProblemDesc& p = problems[pi];
    for (uint32_t e = 0; e < static_cast<uint32_t>(E); ++e) {
      const uint32_t rows = ProblemRows(p, static_cast<uint64_t>(counts[e]));
      if (rows == 0 || p.n == 0) continue;
      for (uint32_t mb = 0; mb < CeilDivU32(rows, p.baseM); ++mb) {
        for (uint32_t nb = 0; nb < CeilDivU32(p.n, p.baseN); ++nb) {
          tiles.push_back(TileRec{pi, e, mb, nb});
          cost.push_back(tile_cost(p, tiles.back(), counts));
        }
      }
    }
  }
  const uint32_t num_tiles = static_cast<uint32_t>(tiles.size());
  const uint32_t cores = std::min<uint32_t>(caps.numAic, num_tiles);
  plan.blockDim = cores;
  std::vector<std::vector<uint32_t>> per_core(cores);
  plan.coreCost.assign(cores, 0.0);
  if (cores > 0) {
    // Longest processing time first: each tile, costliest first, to the least loaded core.
    std::vector<uint32_t> order(num_tiles);
    std::iota(order.begin(), order.end(), 0u);
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return cost[a] > cost[b]; });
    using Load = std::pair<double, uint32_t>;
    std::priority_queue<Load, std::vector<Load>, std::greater<Load>> heap;
    for (uint32_t c = 0; c < cores; ++c) heap.push({0.0, c});
    for (uint32_t i : order) {
      auto [load, c] = heap.top();
      heap.pop();
      per_core[c].push_back(i);
      heap.push({load + cost[i], c});
      plan.coreCost[c] += cost[i];
    }
    // Within a core, enumeration order: neighbouring tiles share an expert's weights in L2.
    for (auto& list : per_core) std::sort(list.begin(), list.end());
  }

  // Serialize: header, core ranges, tiles, row offsets.
  KernelTiling h{};
  h.magic = kTilingMagic;
  h.version = kTilingVersion;
  h.numProblems = static_cast<uint32_t>(problems.size());
  h.numExperts = static_cast<uint32_t>(E);
  h.numCores = cores;
  h.numTiles = num_tiles;
  UbRow row;
  for (const ProblemDesc& p : problems) {
    h.a1Bytes = std::max(h.a1Bytes, p.baseM * p.kL1 * kElemBytes);
    h.b1Bytes = std::max(h.b1Bytes, p.kL1 * p.baseN * kElemBytes);
    h.a2Bytes = std::max(h.a2Bytes, p.baseM * p.baseK * kElemBytes);
    h.b2Bytes = std::max(h.b2Bytes, p.baseK * p.baseN * kElemBytes);
    h.c1Bytes = std::max(h.c1Bytes, p.baseM * p.baseN * 4);
    h.wsSlotFloats = std::max(h.wsSlotFloats, p.numTerms * p.baseM * p.baseN);
    row.acc = std::max(row.acc, p.numTerms * p.baseN * 4);
    if (has_mask(p)) {
      row.mask = std::max(row.mask, p.baseN * kElemBytes);
      row.mask_f32 = std::max(row.mask_f32, p.baseN * 4);
    }
    row.out = std::max(row.out, p.baseN * kElemBytes);
  }
  const Budgets b = budgets_for(caps);
  uint32_t epi_rows = row.total() > 0 ? b.ub / row.total() : 0;
  if (SLMOE_MUTANT(17)) epi_rows *= 2;  // oversize epilogue chunk: UB overflow
  if (!problems.empty() && epi_rows == 0) {
    throw std::invalid_argument("slmoe ascend tiling: the unified buffer cannot hold one epilogue row");
  }
  uint32_t chunk = 0;
  for (ProblemDesc& p : problems) {
    p.epiRows = std::min(epi_rows, CeilDivU32(p.baseM, 2));  // each vector unit takes half the rows
    chunk = std::max(chunk, p.epiRows);
  }
  h.accBytes = chunk * row.acc;
  h.maskBytes = chunk * row.mask;
  h.maskF32Bytes = chunk * row.mask_f32;
  h.outBytes = chunk * row.out;
  for (size_t i = 0; i < problems.size(); ++i) h.problems[i] = problems[i];

  auto align8 = [](size_t v) { return (v + 7) / 8 * 8; };
  h.coreTileBeginOffset = static_cast<uint32_t>(sizeof(KernelTiling));
  h.tilesOffset = static_cast<uint32_t>(align8(h.coreTileBeginOffset + (cores + 1) * sizeof(uint32_t)));
  h.rowOffsetOffset = static_cast<uint32_t>(h.tilesOffset + num_tiles * sizeof(TileRec));
  const size_t total = h.rowOffsetOffset + (E + 1) * sizeof(uint64_t);
  plan.tiling.assign(total, 0);
  std::memcpy(plan.tiling.data(), &h, sizeof h);
  auto* begin = reinterpret_cast<uint32_t*>(plan.tiling.data() + h.coreTileBeginOffset);
  auto* out_tiles = reinterpret_cast<TileRec*>(plan.tiling.data() + h.tilesOffset);
  uint32_t pos = 0;
  for (uint32_t c = 0; c < cores; ++c) {
    begin[c] = pos;
    for (uint32_t i : per_core[c]) out_tiles[pos++] = tiles[i];
  }
  begin[cores] = pos;
  auto* row_offset = reinterpret_cast<uint64_t*>(plan.tiling.data() + h.rowOffsetOffset);
  row_offset[0] = 0;
  for (int64_t e = 0; e < E; ++e) row_offset[e + 1] = row_offset[e] + static_cast<uint64_t>(counts[e]);
  plan.workspaceBytes = static_cast<uint64_t>(cores) * kWorkspaceSlots * h.wsSlotFloats * sizeof(float);
}

LaunchPlan make_launch(const char* name, std::vector<ProblemDesc> problems, const int64_t* counts, int64_t E,
                       const HwCaps& caps) {
  LaunchPlan plan;
  plan.name = name;
  const Budgets b = budgets_for(caps);
  for (ProblemDesc& p : problems) choose_cube_tile(p, counts, E, b, caps.numAic);
  assign_tiles(plan, problems, counts, E, caps);
  return plan;
}

}  // namespace

Budgets budgets_for(const HwCaps& caps) {
  // Two buffers of each: A1 + B1 take 7/8 of L1; L0A, L0B and L0C are halved for double buffering;
  // the vector units keep 1/8 of UB free.
  return Budgets{caps.l1Bytes * 3 / 16, caps.l1Bytes / 4, caps.l0aBytes / 2, caps.l0bBytes / 2, caps.l0cBytes / 2,
                 caps.ubBytes / 8 * 7};
}

uint32_t problem_rows(const ProblemDesc& p, const int64_t* counts, uint32_t e) {
  return ProblemRows(p, static_cast<uint64_t>(counts[e]));
}

uint32_t term_k(const TermDesc& t, const int64_t* counts, uint32_t e) {
  return TermK(t, static_cast<uint64_t>(counts[e]));
}

double tile_cost(const ProblemDesc& p, const TileRec& t, const int64_t* counts) {
  const uint32_t rows = problem_rows(p, counts, t.expert);
  const TileExtent x = TileExtentOf(p, t, rows);
  // Cube: 16x16x16 multiply-adds per cycle; vector: ~128 output elements per cycle over the two
  // vector units, a few operations each; plus a fixed cost per tile (DMA setup, handshakes).
  double cube = 0.0;
  for (uint32_t i = 0; i < p.numTerms; ++i) {
    const uint32_t k = term_k(p.terms[i], counts, t.expert);
    cube += static_cast<double>(align16(x.mLen)) * align16(x.nLen) * align16(k) / 4096.0;
  }
  const double epilogue = static_cast<double>(x.mLen) * x.nLen * (2.0 * p.numTerms + 2.0) / 128.0;
  return cube + epilogue + 256.0;
}

std::vector<LaunchPlan> plan_forward(const LoraDims& d, const int64_t* counts, const HwCaps& caps) {
  std::vector<LaunchPlan> plans;
  // h = lora_x A^T: [T, r]
  plans.push_back(make_launch(
      "fwd_h",
      {problem({term(grouped(kTensorLoraX, kLayoutRowMajor, d.d_in),
                     per_expert(kTensorLoraA, kLayoutRowMajor, d.d_in, d.r * d.d_in), d.d_in, false, 1.0)},
               grouped(kTensorH, kLayoutRowMajor, d.r), true, 0, d.r)},
      counts, d.E, caps));
  // y = x W^T + s h B^T: [T, d_out]
  plans.push_back(make_launch(
      "fwd_y",
      {problem({term(grouped(kTensorX, kLayoutRowMajor, d.d_in),
                     per_expert(kTensorWeight, kLayoutRowMajor, d.d_in, d.d_out * d.d_in), d.d_in, false, 1.0),
                term(grouped(kTensorH, kLayoutRowMajor, d.r),
                     per_expert(kTensorLoraB, kLayoutRowMajor, d.r, d.d_out * d.r), d.r, false, d.scaling)},
               grouped(kTensorY, kLayoutRowMajor, d.d_out), true, 0, d.d_out)},
      counts, d.E, caps));
  return plans;
}

std::vector<LaunchPlan> plan_backward(const LoraDims& d, const int64_t* counts, bool with_mask, bool need_dx,
                                      bool need_da, bool need_db, const HwCaps& caps) {
  std::vector<LaunchPlan> plans;
  std::vector<ProblemDesc> first, second;
  if (need_dx || need_da) {
    // dh = s dy B: [T, r]; B stored [d_out, r] = [K, N]
    first.push_back(problem({term(grouped(kTensorGradY, kLayoutRowMajor, d.d_out),
                                  per_expert(kTensorLoraB, kLayoutTransposed, d.r, d.d_out * d.r), d.d_out, false,
                                  d.scaling)},
                            grouped(kTensorDh, kLayoutRowMajor, d.r), true, 0, d.r));
  }
  if (need_db) {
    // dB_e = s dy_e^T h_e: [d_out, r], K = the expert's rows; dy_e stored [K, M], h_e stored [K, N]
    first.push_back(problem({term(grouped(kTensorGradY, kLayoutTransposed, d.d_out),
                                  grouped(kTensorH, kLayoutTransposed, d.r), 0, true, d.scaling)},
                            per_expert(kTensorDb, kLayoutRowMajor, d.r, d.d_out * d.r), false, d.d_out, d.r));
  }
  if (need_dx) {
    // dx = dy W + (dh A) [* mask]: [T, d_in]; W stored [d_out, d_in] = [K, N], A stored [r, d_in] = [K, N]
    TermDesc lora = term(grouped(kTensorDh, kLayoutRowMajor, d.r),
                         per_expert(kTensorLoraA, kLayoutTransposed, d.d_in, d.r * d.d_in), d.r, false, 1.0);
    if (with_mask) lora.mask = grouped(kTensorMask, kLayoutRowMajor, d.d_in);
    second.push_back(problem({term(grouped(kTensorGradY, kLayoutRowMajor, d.d_out),
                                   per_expert(kTensorWeight, kLayoutTransposed, d.d_in, d.d_out * d.d_in), d.d_out,
                                   false, 1.0),
                              lora},
                             grouped(kTensorDx, kLayoutRowMajor, d.d_in), true, 0, d.d_in));
  }
  if (need_da) {
    // dA_e = dh_e^T lora_x_e: [r, d_in], K = the expert's rows; dh_e stored [K, M], lora_x_e stored [K, N]
    second.push_back(problem({term(grouped(kTensorDh, kLayoutTransposed, d.r),
                                   grouped(kTensorLoraX, kLayoutTransposed, d.d_in), 0, true, 1.0)},
                             per_expert(kTensorDa, kLayoutRowMajor, d.d_in, d.r * d.d_in), false, d.r, d.d_in));
  }
  if (!first.empty()) plans.push_back(make_launch("bwd_dh_db", first, counts, d.E, caps));
  if (!second.empty()) plans.push_back(make_launch("bwd_dx_da", second, counts, d.E, caps));
  return plans;
}

const KernelTiling& tiling_header(const LaunchPlan& plan) {
  return *reinterpret_cast<const KernelTiling*>(plan.tiling.data());
}
const uint32_t* tiling_core_begin(const LaunchPlan& plan) {
  return reinterpret_cast<const uint32_t*>(plan.tiling.data() + tiling_header(plan).coreTileBeginOffset);
}
const TileRec* tiling_tiles(const LaunchPlan& plan) {
  return reinterpret_cast<const TileRec*>(plan.tiling.data() + tiling_header(plan).tilesOffset);
}
const uint64_t* tiling_row_offsets(const LaunchPlan& plan) {
  return reinterpret_cast<const uint64_t*>(plan.tiling.data() + tiling_header(plan).rowOffsetOffset);
}

}  // namespace slmoe_ascend
