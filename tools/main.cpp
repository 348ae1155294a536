// Placeholder until the command lands; replaced by tools/moeblaze_main.cpp.
#include <cstdio>
int main() { std::puts("moeblaze: command not built yet"); return 1; }
