// Output of the `moeblaze` commands: aligned text tables for people, JSON lines for tools
// (docs/DESIGN.md's result rows), and the metadata every result row carries (machine, commit,
// date). No JSON library: rows are flat objects of strings and numbers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace moeblaze::tools {

enum class Align { left, right };

struct Column {
  std::string header;
  Align align = Align::right;
};

// Columns are padded to their widest cell and separated by " | ", with a dashed rule under the
// header, so the table pastes into Markdown-ish text as is.
class Table {
 public:
  explicit Table(std::vector<Column> columns);
  // Throws std::logic_error if the row's cell count differs from the column count.
  void add_row(std::vector<std::string> cells);
  void print(std::ostream& os) const;
  size_t rows() const { return rows_.size(); }

 private:
  std::vector<Column> columns_;
  std::vector<std::vector<std::string>> rows_;
};

// One JSON object on one line, keys in insertion order. Non-finite numbers are written as null
// (JSON has no NaN/Inf).
class JsonLine {
 public:
  JsonLine& add(const std::string& key, const std::string& value);
  JsonLine& add(const std::string& key, const char* value);
  JsonLine& add(const std::string& key, int64_t value);
  JsonLine& add(const std::string& key, uint64_t value);
  JsonLine& add(const std::string& key, int value) { return add(key, static_cast<int64_t>(value)); }
  JsonLine& add(const std::string& key, double value);
  JsonLine& add(const std::string& key, bool value);
  JsonLine& add_null(const std::string& key);
  JsonLine& add(const std::string& key, const JsonLine& object);  // a nested object
  JsonLine& add(const std::string& key, const std::vector<double>& values);  // an array
  std::string str() const;  // {"key": value, ...} without a trailing newline

 private:
  std::vector<std::pair<std::string, std::string>> fields_;  // key, encoded value
};

// "a, b,,c" -> {"a", "b", "", "c"}: blanks trimmed, empty entries kept so that callers can
// reject them by name.
std::vector<std::string> split_commas(const std::string& s);

std::string json_escape(const std::string& s);  // the quoted JSON string literal of s

// Formatting helpers.
std::string fixed(double v, int decimals);      // "12.35"; "-" when not finite
std::string scientific(double v, int digits);   // "3.1e-03"; "-" when not finite
// "512 B", "12.0 KiB", "12.0 MiB", "1.50 GiB"; a double so that an estimate past 2^64 bytes
// prints as what it is instead of wrapping.
std::string human_bytes(double bytes);

// Row metadata.
std::string cpu_model();     // "model name" of /proc/cpuinfo, "unknown cpu" when unreadable
std::string git_commit();    // $MOEBLAZE_COMMIT when set; else the short commit of the source
                             // tree the binary was built in, with "-dirty" when tracked files
                             // differ; "unknown" without git
std::string utc_date_iso();  // "2026-11-29T12:46:02Z"

}  // namespace moeblaze::tools
