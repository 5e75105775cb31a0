#include "model/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <mutex>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "re2/re2.h"

namespace strata::model {
namespace {

using Json = nlohmann::json;

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", what));
}

// The member `key` of an object, or nullptr. (A const json's operator[] on a missing key is
// undefined behaviour in nlohmann::json, so every lookup goes through here.)
const Json* Member(const Json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  const auto it = j.find(key);
  return it == j.end() ? nullptr : &*it;
}

bool IsString(const Json* j, absl::string_view value) {
  return j != nullptr && j->is_string() && j->get<std::string>() == value;
}

// GPT-2's reversible map from bytes to printable code points, as UTF-8 strings.
std::vector<std::string> ByteAlphabet() {
  std::vector<int> cp(256, -1);
  for (int b = '!'; b <= '~'; ++b) cp[b] = b;
  for (int b = 0xa1; b <= 0xac; ++b) cp[b] = b;
  for (int b = 0xae; b <= 0xff; ++b) cp[b] = b;
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    if (cp[b] < 0) cp[b] = 256 + n++;
  }
  std::vector<std::string> out(256);
  for (int b = 0; b < 256; ++b) {
    const int c = cp[b];
    if (c < 0x80) {
      out[b] = std::string(1, static_cast<char>(c));
    } else {
      out[b] = {static_cast<char>(0xc0 | (c >> 6)), static_cast<char>(0x80 | (c & 0x3f))};
    }
  }
  return out;
}

// Unicode White_Space, which Hugging Face's \s means (Oniguruma); RE2's \s is ASCII only.
constexpr char kWhiteSpaceClassBody[] =
    R"(\t\n\x0B\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F})"
    R"(\x{205F}\x{3000})";

// Rewrites \s and \S in a pattern to the Unicode White_Space class, inside and outside
// character classes (\S inside a class is rejected: RE2 cannot subtract classes).
absl::StatusOr<std::string> UnicodeWhitespace(absl::string_view p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      if (e == 's') {
        out += in_class ? kWhiteSpaceClassBody : absl::StrCat("[", kWhiteSpaceClassBody, "]");
      } else if (e == 'S') {
        if (in_class) return Bad("\\S inside a character class is not supported");
        out += absl::StrCat("[^", kWhiteSpaceClassBody, "]");
      } else {
        out.append(p.data() + i, 2);
      }
      ++i;
      continue;
    }
    if (c == '[' && !in_class)
      in_class = true;
    else if (c == ']' && in_class)
      in_class = false;
    out += c;
  }
  return out;
}

// Length in bytes of the UTF-8 sequence starting with lead byte c (1 for invalid bytes).
size_t Utf8Len(unsigned char c) {
  if (c >= 0xf0 && c <= 0xf4) return 4;
  if (c >= 0xe0) return 3;
  if (c >= 0xc2 && c < 0xe0) return 2;
  return 1;
}

bool IsSpaceCodepoint(absl::string_view s, size_t pos, size_t* len) {
  // The characters \s matches in RE2's Unicode mode that can end a whitespace run.
  const unsigned char c = s[pos];
  *len = std::min(Utf8Len(c), s.size() - pos);
  static const RE2 kSpace(absl::StrCat("[", kWhiteSpaceClassBody, "]"));
  const absl::string_view c1 = s.substr(pos, *len);
  return RE2::FullMatch(re2::StringPiece(c1.data(), c1.size()), kSpace);
}

}  // namespace

struct Tokenizer::Impl {
  std::unordered_map<std::string, uint32_t> vocab;
  std::vector<std::string> id_to_token;
  std::unordered_map<std::string, uint32_t> merge_rank;  // "a b" -> rank
  std::vector<std::pair<std::string, uint32_t>> added;   // content, id; longest first
  std::vector<bool> is_added;
  std::unique_ptr<RE2> split;  // pre-tokenizer regex (may be null: whole text is one piece)
  int lookahead_group = -1;    // capture group of the emulated `\s+(?!\S)`, or -1
  bool ignore_merges = false;
  std::vector<std::string> byte_alphabet = ByteAlphabet();
  std::unordered_map<std::string, uint8_t> alphabet_byte;
  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<uint32_t>> cache;

  void Pretokenize(absl::string_view text, std::vector<absl::string_view>* out) const;
  void Bpe(const std::string& word, std::vector<uint32_t>* out) const;
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& dir) {
  const std::string path = dir + "/tokenizer.json";
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return FromJson(ss.str());
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(absl::string_view text) {
  const Json j = Json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Bad("not a JSON object");
  auto impl = std::make_unique<Impl>();
  for (int b = 0; b < 256; ++b)
    impl->alphabet_byte[impl->byte_alphabet[b]] = static_cast<uint8_t>(b);
  const auto model = j.find("model");
  if (model == j.end() || !model->is_object()) return Bad("no model");
  if (!IsString(Member(*model, "type"), "BPE")) return Bad("model type is not BPE");
  const auto vocab = model->find("vocab");
  if (vocab == model->end() || !vocab->is_object()) return Bad("model has no vocab object");
  uint32_t max_id = 0;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_unsigned() || it.value().get<uint64_t>() >= (1u << 24)) {
      return Bad(absl::StrCat("vocab entry '", it.key(), "' has no valid id"));
    }
    const uint32_t id = it.value().get<uint32_t>();
    impl->vocab[it.key()] = id;
    max_id = std::max(max_id, id);
  }
  if (const auto added = j.find("added_tokens"); added != j.end() && added->is_array()) {
    for (const Json& a : *added) {
      const Json* id_j = Member(a, "id");
      const Json* content = Member(a, "content");
      if (id_j == nullptr || content == nullptr || !id_j->is_number_unsigned() ||
          !content->is_string() || id_j->get<uint64_t>() >= (1u << 24)) {
        return Bad("an added token needs an id and a content");
      }
      const uint32_t id = id_j->get<uint32_t>();
      impl->added.emplace_back(content->get<std::string>(), id);
      impl->vocab[content->get<std::string>()] = id;
      max_id = std::max(max_id, id);
    }
  }
  std::sort(impl->added.begin(), impl->added.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  impl->id_to_token.resize(max_id + 1);
  impl->is_added.assign(max_id + 1, false);
  for (const auto& [tok, id] : impl->vocab) impl->id_to_token[id] = tok;
  for (const auto& [tok, id] : impl->added) impl->is_added[id] = true;
  const auto merges = model->find("merges");
  if (merges == model->end() || !merges->is_array()) return Bad("model has no merges list");
  uint32_t rank = 0;
  for (const Json& m : *merges) {
    std::string key;
    if (m.is_string()) {
      key = m.get<std::string>();
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      key = m[0].get<std::string>() + " " + m[1].get<std::string>();
    } else {
      return Bad(absl::StrCat("merge ", rank, " is neither \"a b\" nor [a, b]"));
    }
    impl->merge_rank.emplace(key, rank++);
  }
  if (const auto im = model->find("ignore_merges"); im != model->end() && im->is_boolean()) {
    impl->ignore_merges = im->get<bool>();
  }
  // Pre-tokenizer: Sequence of Split + ByteLevel(use_regex false), or ByteLevel(use_regex
  // true) with GPT-2's pattern.
  std::string pattern;
  const Json* pre = Member(j, "pre_tokenizer");
  std::vector<const Json*> steps;
  if (pre != nullptr && pre->is_object()) {
    const Json* list = Member(*pre, "pretokenizers");
    if (IsString(Member(*pre, "type"), "Sequence") && list != nullptr && list->is_array()) {
      for (const Json& p : *list) steps.push_back(&p);
    } else {
      steps.push_back(pre);
    }
  }
  if (const Json* norm = Member(j, "normalizer"); norm != nullptr && !norm->is_null()) {
    return Bad("normalizers are not supported (only byte-level BPE tokenizers are)");
  }
  if (const Json* bf = Member(*model, "byte_fallback");
      bf != nullptr && bf->is_boolean() && bf->get<bool>()) {
    return Bad("byte_fallback (SentencePiece-style BPE) is not supported");
  }
  bool byte_level = false;
  for (const Json* p : steps) {
    const Json* type_j = Member(*p, "type");
    if (type_j == nullptr || !type_j->is_string()) return Bad("pre-tokenizer without a type");
    const std::string type = type_j->get<std::string>();
    if (type == "Split") {
      const Json* pat = Member(*p, "pattern");
      const Json* regex = pat != nullptr ? Member(*pat, "Regex") : nullptr;
      if (regex == nullptr || !regex->is_string()) {
        return Bad("Split pre-tokenizer needs a Regex pattern");
      }
      if (!pattern.empty()) return Bad("more than one Split pre-tokenizer is not supported");
      const Json* behavior = Member(*p, "behavior");
      const Json* invert = Member(*p, "invert");
      if ((behavior != nullptr && !IsString(behavior, "Isolated")) ||
          (invert != nullptr && !(invert->is_boolean() && !invert->get<bool>()))) {
        return Bad("only Split with behavior Isolated and invert false is supported");
      }
      pattern = regex->get<std::string>();
    } else if (type == "ByteLevel") {
      byte_level = true;
      const Json* prefix = Member(*p, "add_prefix_space");
      if (prefix != nullptr && prefix->is_boolean() && prefix->get<bool>()) {
        return Bad("ByteLevel add_prefix_space is not supported");
      }
      // Hugging Face's default for a missing use_regex is true (GPT-2's pattern).
      const Json* use_regex = Member(*p, "use_regex");
      const bool regex_on =
          use_regex == nullptr || (use_regex->is_boolean() && use_regex->get<bool>());
      if (regex_on && pattern.empty()) {
        pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
      }
    } else {
      return Bad(absl::StrCat("pre-tokenizer '", type, "' is not supported"));
    }
  }
  if (!byte_level) return Bad("no ByteLevel pre-tokenizer: not a byte-level BPE tokenizer");
  if (!pattern.empty()) {
    const std::string kLookahead = R"(\s+(?!\S))";
    const size_t at = pattern.find(kLookahead);
    if (at != std::string::npos) {
      pattern.replace(at, kLookahead.size(), R"((?P<strata_ws>\s+))");
    }
    absl::StatusOr<std::string> unicode = UnicodeWhitespace(pattern);
    if (!unicode.ok()) return unicode.status();
    RE2::Options opts;
    opts.set_log_errors(false);
    impl->split = std::make_unique<RE2>(*unicode, opts);
    if (!impl->split->ok()) {
      return Bad(
          absl::StrCat("pre-tokenizer regex does not compile in RE2: ", impl->split->error()));
    }
    const auto& groups = impl->split->NamedCapturingGroups();
    if (const auto g = groups.find("strata_ws"); g != groups.end())
      impl->lookahead_group = g->second;
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

void Tokenizer::Impl::Pretokenize(absl::string_view text,
                                  std::vector<absl::string_view>* out) const {
  if (!split) {
    out->push_back(text);
    return;
  }
  const int groups = split->NumberOfCapturingGroups();
  std::vector<re2::StringPiece> sub(groups + 1);
  size_t pos = 0;
  while (pos < text.size()) {
    const re2::StringPiece input(text.data(), text.size());
    if (!split->Match(input, pos, text.size(), RE2::UNANCHORED, sub.data(), groups + 1) ||
        sub[0].empty()) {
      out->push_back(text.substr(pos));  // nothing matches: the rest is one piece
      return;
    }
    const size_t begin = sub[0].data() - text.data();
    if (begin > pos) out->push_back(text.substr(pos, begin - pos));  // unmatched gap
    size_t end = begin + sub[0].size();
    // `\s+(?!\S)`: a whitespace run followed by a non-space keeps its last character back.
    if (lookahead_group >= 0 && sub[lookahead_group].data() != nullptr && end < text.size()) {
      size_t len = 0;
      if (!IsSpaceCodepoint(text, end, &len)) {
        size_t last = end - 1;  // step back one code point
        while (last > begin && (static_cast<unsigned char>(text[last]) & 0xc0) == 0x80) --last;
        if (last > begin) end = last;
      }
    }
    out->push_back(text.substr(begin, end - begin));
    pos = end;
  }
}

void Tokenizer::Impl::Bpe(const std::string& word, std::vector<uint32_t>* out) const {
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    if (const auto it = cache.find(word); it != cache.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<uint32_t> ids;
  const auto whole = vocab.find(word);
  if (ignore_merges && whole != vocab.end()) {
    ids.push_back(whole->second);
  } else {
    // Lowest-rank pair first, leftmost among equals (Hugging Face's order), with a heap over a
    // linked list of symbols: O(n log n) even for very long words.
    std::vector<std::string> syms;  // one per code point of the byte-alphabet word
    for (size_t i = 0; i < word.size();) {
      const size_t n = std::min(Utf8Len(word[i]), word.size() - i);
      syms.push_back(word.substr(i, n));
      i += n;
    }
    const int n = static_cast<int>(syms.size());
    std::vector<int> prev(n), next(n);
    std::vector<bool> alive(n, true);
    for (int i = 0; i < n; ++i) {
      prev[i] = i - 1;
      next[i] = i + 1 < n ? i + 1 : -1;
    }
    using Entry = std::pair<uint32_t, int>;  // (rank, left symbol)
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
    auto push = [&](int i) {
      if (i < 0 || next[i] < 0) return;
      const auto r = merge_rank.find(syms[i] + " " + syms[next[i]]);
      if (r != merge_rank.end()) heap.push({r->second, i});
    };
    for (int i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      const auto [rank, i] = heap.top();
      heap.pop();
      if (!alive[i] || next[i] < 0) continue;
      const auto r = merge_rank.find(syms[i] + " " + syms[next[i]]);
      if (r == merge_rank.end() || r->second != rank) continue;  // stale entry
      const int j = next[i];
      syms[i] += syms[j];
      alive[j] = false;
      next[i] = next[j];
      if (next[j] >= 0) prev[next[j]] = i;
      push(prev[i]);
      push(i);
    }
    std::vector<std::string> merged;
    for (int i = 0; i >= 0 && i < n; i = next[i]) merged.push_back(std::move(syms[i]));
    syms = std::move(merged);
    for (const std::string& s : syms) {
      const auto it = vocab.find(s);
      if (it != vocab.end()) {
        ids.push_back(it->second);
      } else {
        // A symbol outside the vocabulary (an incomplete tokenizer): fall back to its bytes.
        for (size_t i = 0; i < s.size();) {
          const size_t n = std::min(Utf8Len(s[i]), s.size() - i);
          const auto b = vocab.find(s.substr(i, n));
          if (b != vocab.end()) ids.push_back(b->second);
          i += n;
        }
      }
    }
  }
  out->insert(out->end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(cache_mu);
  if (cache.size() < (1u << 16) && word.size() <= 256) cache.emplace(word, std::move(ids));
}

std::vector<uint32_t> Tokenizer::Encode(absl::string_view text, bool parse_special) const {
  std::vector<uint32_t> ids;
  std::vector<absl::string_view> pieces;
  auto encode_plain = [&](absl::string_view s) {
    pieces.clear();
    impl_->Pretokenize(s, &pieces);
    for (absl::string_view p : pieces) {
      std::string word;
      for (unsigned char c : p) word += impl_->byte_alphabet[c];
      impl_->Bpe(word, &ids);
    }
  };
  size_t start = 0, pos = 0;
  while (parse_special && pos < text.size()) {
    bool hit = false;
    for (const auto& [content, id] : impl_->added) {
      if (!content.empty() && text.substr(pos, content.size()) == content) {
        encode_plain(text.substr(start, pos - start));
        ids.push_back(id);
        pos += content.size();
        start = pos;
        hit = true;
        break;
      }
    }
    if (!hit) ++pos;
  }
  encode_plain(text.substr(start));
  return ids;
}

absl::StatusOr<std::string> Tokenizer::Decode(const std::vector<uint32_t>& ids) const {
  std::string out;
  for (uint32_t id : ids) {
    if (id >= impl_->id_to_token.size() || impl_->id_to_token[id].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer: id ", id, " is not in the vocabulary"));
    }
    const std::string& tok = impl_->id_to_token[id];
    if (impl_->is_added[id]) {
      out += tok;
      continue;
    }
    for (size_t i = 0; i < tok.size();) {
      const size_t n = std::min(Utf8Len(tok[i]), tok.size() - i);
      const auto b = impl_->alphabet_byte.find(tok.substr(i, n));
      if (b != impl_->alphabet_byte.end()) out += static_cast<char>(b->second);
      i += n;
    }
  }
  return out;
}

uint32_t Tokenizer::vocab_size() const { return static_cast<uint32_t>(impl_->id_to_token.size()); }

int64_t Tokenizer::TokenId(absl::string_view token) const {
  const auto it = impl_->vocab.find(std::string(token));
  return it == impl_->vocab.end() ? -1 : it->second;
}

}  // namespace strata::model
