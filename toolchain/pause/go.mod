// The pod sandbox's pause process for the real node (tier c): a static binary, no dependencies.
module kvtopo.dev/toolchain/pause

go 1.26.0
