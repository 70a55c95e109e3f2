// A small JSON reader, enough for mirrorsd.json: objects, arrays, strings (with \uXXXX escapes), numbers, true,
// false, null. Written for mirrorsd; no third-party code. Throws std::runtime_error with a byte offset.
#pragma once

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace mirrorsd::json {

class Value {
 public:
  enum class Kind { Null, Bool, Number, String, Array, Object };

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::Null; }

  bool as_bool() const { return expect(Kind::Bool, "a boolean").bool_; }
  double as_number() const { return expect(Kind::Number, "a number").number_; }
  int64_t as_int() const {
    double n = as_number();
    if (n != static_cast<double>(static_cast<int64_t>(n))) throw std::runtime_error("expected an integer");
    return static_cast<int64_t>(n);
  }
  const std::string& as_string() const { return expect(Kind::String, "a string").string_; }
  const std::vector<Value>& items() const { return expect(Kind::Array, "an array").items_; }
  const std::vector<std::pair<std::string, Value>>& members() const {
    return expect(Kind::Object, "an object").members_;
  }

  // Object member by key (throws when absent) and array element by index.
  const Value& at(const std::string& key) const {
    for (const auto& [k, v] : members())
      if (k == key) return v;
    throw std::runtime_error("missing key '" + key + "'");
  }
  bool has(const std::string& key) const {
    for (const auto& member : members())
      if (member.first == key) return true;
    return false;
  }
  const Value& operator[](size_t i) const { return items().at(i); }

 private:
  friend class Parser;
  const Value& expect(Kind kind, const char* what) const {
    if (kind_ != kind) throw std::runtime_error(std::string("expected ") + what);
    return *this;
  }

  Kind kind_ = Kind::Null;
  bool bool_ = false;
  double number_ = 0;
  std::string string_;
  std::vector<Value> items_;
  std::vector<std::pair<std::string, Value>> members_;
};

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}

  Value parse_document() {
    Value v = parse_value(0);
    skip_space();
    if (pos_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 256;  // mirrorsd.json nests 6 deep; this only stops runaway recursion

  [[noreturn]] void fail(const std::string& why) const {
    throw std::runtime_error("JSON: " + why + " at byte " + std::to_string(pos_));
  }
  void skip_space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t')) ++pos_;
  }
  char peek() {
    skip_space();
    if (pos_ >= s_.size()) fail("unexpected end");
    return s_[pos_];
  }
  bool consume(const char* word) {
    size_t n = std::char_traits<char>::length(word);
    if (s_.compare(pos_, n, word) != 0) return false;
    pos_ += n;
    return true;
  }

  Value parse_value(int depth) {
    if (depth > kMaxDepth) fail("nesting too deep");
    Value v;
    char c = peek();
    if (c == '{') {
      v.kind_ = Value::Kind::Object;
      ++pos_;
      if (peek() == '}') { ++pos_; return v; }
      while (true) {
        if (peek() != '"') fail("expected a key");
        std::string key = parse_string();
        if (peek() != ':') fail("expected ':'");
        ++pos_;
        v.members_.emplace_back(std::move(key), parse_value(depth + 1));
        char next = peek();
        ++pos_;
        if (next == '}') return v;
        if (next != ',') fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      v.kind_ = Value::Kind::Array;
      ++pos_;
      if (peek() == ']') { ++pos_; return v; }
      while (true) {
        v.items_.push_back(parse_value(depth + 1));
        char next = peek();
        ++pos_;
        if (next == ']') return v;
        if (next != ',') fail("expected ',' or ']'");
      }
    }
    if (c == '"') {
      v.kind_ = Value::Kind::String;
      v.string_ = parse_string();
      return v;
    }
    if (consume("true")) { v.kind_ = Value::Kind::Bool; v.bool_ = true; return v; }
    if (consume("false")) { v.kind_ = Value::Kind::Bool; return v; }
    if (consume("null")) return v;
    v.kind_ = Value::Kind::Number;
    v.number_ = parse_number();
    return v;
  }

  double parse_number() {
    size_t start = pos_;
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    auto digits = [&] {
      size_t d = pos_;
      while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
      return pos_ > d;
    };
    if (!digits()) fail("bad number");
    if (pos_ < s_.size() && s_[pos_] == '.') { ++pos_; if (!digits()) fail("bad fraction"); }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (!digits()) fail("bad exponent");
    }
    return std::strtod(s_.substr(start, pos_ - start).c_str(), nullptr);
  }

  unsigned hex4() {
    if (pos_ + 4 > s_.size()) fail("short \\u escape");
    unsigned code = 0;
    for (int i = 0; i < 4; ++i) {
      char h = s_[pos_++];
      code <<= 4;
      if (h >= '0' && h <= '9') code |= h - '0';
      else if (h >= 'a' && h <= 'f') code |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F') code |= h - 'A' + 10;
      else fail("bad hex digit");
    }
    return code;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') { out += c; continue; }
      if (pos_ >= s_.size()) fail("unterminated escape");
      char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // high surrogate: a low one must follow
            if (!consume("\\u")) fail("lone high surrogate");
            unsigned low = hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("bad low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("lone low surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("bad escape");
      }
    }
  }

  const std::string& s_;
  size_t pos_ = 0;
};

inline Value parse(const std::string& text) { return Parser(text).parse_document(); }

}  // namespace mirrorsd::json
