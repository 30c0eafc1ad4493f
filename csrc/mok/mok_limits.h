// The sizes every MoK launch is checked against (host and device code; plain C++).
#pragma once

#define MOK_MAX_RANKS 72          // EP ranks: one NVLink domain (NVL72)
#define MOK_MAX_LOCAL_EXPERTS 512
#define MOK_MAX_EXPERTS 8192
#define MOK_MAX_SLOTS 64          // ring slots
