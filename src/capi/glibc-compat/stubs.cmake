# moeblaze_link_old_glibc(<target>): links <target> so that it needs the pre-2.34 versions of the
# glibc functions listed in old-versions.txt (that file says why and how). For each soname there
# (libpthread.so.0, libdl.so.2, librt.so.1) it builds a stub shared library whose default versions
# are the old ones, and puts the stubs on the link line ahead of libc.so.6: the linker binds each
# reference to the first definition it meets, the stub's, and records `sym@GLIBC_old` needed from
# that soname. --no-as-needed keeps the stubs' sonames NEEDED even where the link line has them
# before the objects that use them (all three are on every glibc and in every manylinux policy).
function(moeblaze_link_old_glibc target)
  set(table "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/old-versions.txt")
  set(dir "${CMAKE_CURRENT_BINARY_DIR}/glibc-compat")
  file(STRINGS "${table}" lines REGEX "^[^#]")
  set(sonames "")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "[ \t]+" ";" fields "${line}")
    list(POP_FRONT fields soname version)
    string(MAKE_C_IDENTIFIER "${soname}" lib)
    string(MAKE_C_IDENTIFIER "${version}" ver)
    if(NOT soname IN_LIST sonames)
      list(APPEND sonames "${soname}")
      set(versions_${lib} "")
    endif()
    if(NOT version IN_LIST versions_${lib})
      list(APPEND versions_${lib} "${version}")
    endif()
    list(APPEND symbols_${lib}_${ver} ${fields})
  endforeach()

  set(stubs "")
  foreach(soname IN LISTS sonames)
    string(MAKE_C_IDENTIFIER "${soname}" lib)
    set(source "// Generated from ${table}: link-time stand-ins, never loaded.\n")
    set(script "")
    set(local "\n  local: *;")  # once, in the first node
    foreach(version IN LISTS versions_${lib})
      string(MAKE_C_IDENTIFIER "${version}" ver)
      string(APPEND script "${version} {\n  global:\n")
      foreach(symbol IN LISTS symbols_${lib}_${ver})
        string(APPEND source "extern \"C\" void ${symbol}() {}\n")
        string(APPEND script "    ${symbol};\n")
      endforeach()
      string(APPEND script "${local}\n};\n")
      set(local "")
    endforeach()
    set(stub "${dir}/stub-${lib}.so")
    # file(GENERATE) rewrites only on change, so a re-configure relinks nothing.
    file(GENERATE OUTPUT "${dir}/stub-${lib}.cpp" CONTENT "${source}")
    file(GENERATE OUTPUT "${dir}/stub-${lib}.map" CONTENT "${script}")
    add_custom_command(
      OUTPUT "${stub}"
      COMMAND "${CMAKE_CXX_COMPILER}" -shared -fPIC -nostdlib -o "${stub}" "${dir}/stub-${lib}.cpp"
              "-Wl,-soname,${soname}" "-Wl,--version-script,${dir}/stub-${lib}.map"
      DEPENDS "${dir}/stub-${lib}.cpp" "${dir}/stub-${lib}.map" "${table}"
      COMMENT "glibc stub ${soname} (old symbol versions)" VERBATIM)
    list(APPEND stubs "${stub}")
  endforeach()

  add_custom_target(${target}_old_glibc_stubs DEPENDS ${stubs})
  add_dependencies(${target} ${target}_old_glibc_stubs)
  set_property(TARGET ${target} APPEND PROPERTY LINK_DEPENDS ${stubs})
  # Link options, not link libraries: CMake would add a library's folder to the RPATH, and the
  # stubs must never be found at run time.
  target_link_options(${target} PRIVATE "LINKER:--push-state,--no-as-needed" ${stubs}
                      "LINKER:--pop-state")
endfunction()
