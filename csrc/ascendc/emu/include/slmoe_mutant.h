// Injected bugs of the emulated build: force-included (-include) into every source the emulation
// compiles, so SLMOE_MUTANT(n) in the kernel and the planner is true when $SLMOE_EMU_MUTATION == n.
// Real builds never see this header and their SLMOE_MUTANT(n) is `false`.
#pragma once

namespace slmoe_emu {
int mutation();
}

#define SLMOE_MUTANT(n) (::slmoe_emu::mutation() == (n))
