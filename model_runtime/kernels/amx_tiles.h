// What both AMX builds' tile kernels share (amx_linear.cpp: bf16 and int8 linears; quant_amx.h: the q4 build's K
// formats): the tile configuration's layout, its load, and the process's permission to use the tiles. Each build has
// one translation unit that includes it, hence the anonymous namespace.
#pragma once
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id; uint8_t start_row; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16];
};

// ldtilecfg through an asm that reads the struct as a memory operand: GCC does not see _tile_loadconfig's builtin
// read through its pointer, and in an out-of-line copy of configure() it dropped the stores that fill the struct
// (every tile then had 0 rows, and the first tile instruction raised #UD: "Illegal instruction")
inline void load_config(const TileConfig& cfg) { __asm__ volatile("ldtilecfg %0" : : "m"(cfg) : "memory"); }

// Linux hands a process the tiles' register state only on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA):
// the loader asks once per build it loads (model_runtime/kernel_registry.py); false where Linux refuses
inline bool amx_enable() {
  return syscall(SYS_arch_prctl, 0x1023 /*ARCH_REQ_XCOMP_PERM*/, 18 /*XFEATURE_XTILEDATA*/) == 0;
}

}  // namespace
