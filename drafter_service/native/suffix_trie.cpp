// The suffix trie of drafter_service/suffix_tree.py in C++: the same counts, the same matches and the same
// proposals, token for token and score for score (tests/drafter_service/test_suffix_native.py compares them
// on random sequences). Python's trie costs ~1 us a node visit and a prompt of L tokens visits 24 L of them; here
// a visit is a hash lookup. drafter_service/suffix_native.py builds it once per machine and falls back to the
// Python trie where it does not build.
//
// Nodes live in one vector (index 0 the root), their children as a linked list (iteration) and in one open-addressing
// map of (parent, token) -> child (lookup); a subtree whose count reaches 0 goes back to a free list.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// (parent, token) -> child, open addressing: a lookup is a multiply and a probe or two, an insert no allocation
class EdgeMap {
 public:
  EdgeMap() : keys_(64, EMPTY), vals_(64, -1) {}

  static uint64_t key(int32_t parent, int64_t token) {
    if (token < 0 || token >= (int64_t{1} << 32)) throw py::value_error("token ids must be in [0, 2^32)");
    return (static_cast<uint64_t>(parent) << 32) | static_cast<uint64_t>(token);
  }

  int32_t find(uint64_t k) const {
    for (size_t i = slot(k);; i = (i + 1) & (keys_.size() - 1)) {
      if (keys_[i] == k) return vals_[i];
      if (keys_[i] == EMPTY) return -1;
    }
  }

  void insert(uint64_t k, int32_t v) {  // k is not in the map
    if (2 * (used_ + 1) > keys_.size()) grow();
    size_t i = slot(k);
    while (keys_[i] != EMPTY && keys_[i] != TOMB) i = (i + 1) & (keys_.size() - 1);
    if (keys_[i] == EMPTY) ++used_;
    keys_[i] = k;
    vals_[i] = v;
  }

  void erase(uint64_t k) {
    for (size_t i = slot(k);; i = (i + 1) & (keys_.size() - 1)) {
      if (keys_[i] == k) {
        keys_[i] = TOMB;
        return;
      }
      if (keys_[i] == EMPTY) return;
    }
  }

 private:
  static constexpr uint64_t EMPTY = ~uint64_t{0}, TOMB = ~uint64_t{0} - 1;

  size_t slot(uint64_t k) const {  // splitmix64's finalizer
    k ^= k >> 30;
    k *= 0xbf58476d1ce4e5b9ull;
    k ^= k >> 27;
    k *= 0x94d049bb133111ebull;
    k ^= k >> 31;
    return static_cast<size_t>(k) & (keys_.size() - 1);
  }

  void grow() {
    std::vector<uint64_t> keys(std::move(keys_));
    std::vector<int32_t> vals(std::move(vals_));
    size_t live = 0;
    for (uint64_t k : keys) live += (k != EMPTY && k != TOMB);
    size_t size = 64;
    while (size < 4 * (live + 1)) size *= 2;
    keys_.assign(size, EMPTY);
    vals_.assign(size, -1);
    used_ = 0;
    for (size_t i = 0; i < keys.size(); ++i)
      if (keys[i] != EMPTY && keys[i] != TOMB) insert(keys[i], vals[i]);
  }

  std::vector<uint64_t> keys_;
  std::vector<int32_t> vals_;
  size_t used_ = 0;  // live and tombstones
};

struct Node {
  int64_t count = 0;
  int64_t last = 0;  // the trie's clock when a sequence last passed through it (ties go to the most recent)
  int64_t token = -1;
  int32_t parent = -1, first = -1, next = -1, prev = -1;  // the children as a doubly linked list
};

// (tokens, parents, scores, match_len), as suffix_tree.Proposal holds them
using Proposal = std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<double>, int64_t>;

class Trie {
 public:
  explicit Trie(int64_t max_depth) : max_depth_(max_depth), nodes_(1) {
    if (max_depth < 2) throw py::value_error("max_depth must be >= 2, got " + std::to_string(max_depth));
  }

  bool contains(int64_t seq_id) const { return tokens_.count(seq_id) > 0; }

  void extend(int64_t seq_id, const std::vector<int64_t>& tokens) {
    auto& own = tokens_[seq_id];
    auto& open = open_[seq_id];
    std::vector<int32_t> moved;
    const size_t keep = static_cast<size_t>(max_depth_ - 1);
    for (int64_t token : tokens) {
      own.push_back(token);
      ++clock_;
      moved.clear();
      const size_t from = open.size() > keep ? open.size() - keep : 0;
      for (size_t i = from; i <= open.size(); ++i) {  // suffixes of length 1..max_depth, the root's last
        const int32_t parent = i < open.size() ? open[i] : 0;
        const int32_t c = child_or_new(parent, token);
        nodes_[c].count += 1;
        nodes_[c].last = clock_;
        moved.push_back(c);
      }
      open.swap(moved);
    }
  }

  void remove(int64_t seq_id) {
    auto it = tokens_.find(seq_id);
    open_.erase(seq_id);
    if (it == tokens_.end()) return;
    const std::vector<int64_t> tokens = std::move(it->second);
    tokens_.erase(it);
    for (size_t start = 0; start < tokens.size(); ++start) {
      int32_t node = 0;
      const size_t end = std::min(tokens.size(), start + static_cast<size_t>(max_depth_));
      for (size_t i = start; i < end; ++i) {
        const int32_t c = edges_.find(EdgeMap::key(node, tokens[i]));
        if (c < 0) throw std::logic_error("suffix trie: a removed path is missing");
        if (--nodes_[c].count == 0) {
          unlink(c);
          release(c);
          break;
        }
        node = c;
      }
    }
  }

  // the node of the longest suffix of `context` (at most max_match tokens) that is a path with children
  std::optional<std::pair<int32_t, int64_t>> match(const std::vector<int64_t>& context, int64_t max_match) const {
    const int64_t n = static_cast<int64_t>(context.size());
    for (int64_t length = std::min({max_match, n, max_depth_ - 1}); length > 0; --length) {
      int32_t node = 0;
      bool found = true;
      for (int64_t i = n - length; i < n; ++i) {
        node = context[i] >= 0 && context[i] < (int64_t{1} << 32) ? edges_.find(EdgeMap::key(node, context[i])) : -1;
        if (node < 0) {
          found = false;
          break;
        }
      }
      if (found && nodes_[node].first >= 0) return std::make_pair(node, length);
    }
    return std::nullopt;
  }

  std::optional<Proposal> propose(const std::vector<int64_t>& context, int64_t budget, double min_score,
                                  int64_t max_match, std::optional<int64_t> levels) const {
    if (budget <= 0) return std::nullopt;
    const auto found = match(context, max_match);
    if (!found) return std::nullopt;
    const auto [start, match_len] = *found;
    // (score, last, -order): the largest first, as Python's heap of (-score, -last, order)
    using Entry = std::tuple<double, int64_t, int64_t, int64_t, int64_t, int32_t>;  // + parent index, token, node
    std::priority_queue<Entry> heap;
    int64_t order = 0;
    std::vector<int64_t> tokens, parents, depth_of;
    std::vector<double> scores;
    auto push = [&](int64_t parent_index, int32_t parent, double parent_score, int64_t depth) {
      if (depth >= max_depth_ - match_len || (levels && depth >= *levels)) return;
      const Node& p = nodes_[parent];
      for (int32_t c = p.first; c >= 0; c = nodes_[c].next) {
        const double score = parent_score * static_cast<double>(nodes_[c].count) / static_cast<double>(p.count);
        if (score > min_score) heap.emplace(score, nodes_[c].last, -(order++), parent_index, nodes_[c].token, c);
      }
    };
    push(-1, start, 1.0, 0);
    while (!heap.empty() && static_cast<int64_t>(tokens.size()) < budget) {
      const auto [score, last, negative_order, parent_index, token, node] = heap.top();
      heap.pop();
      tokens.push_back(token);
      parents.push_back(parent_index);
      scores.push_back(score);
      depth_of.push_back(parent_index < 0 ? 1 : depth_of[parent_index] + 1);
      push(static_cast<int64_t>(tokens.size()) - 1, node, score, depth_of.back());
    }
    if (tokens.empty()) return std::nullopt;
    return Proposal(tokens, parents, scores, match_len);
  }

  // every path and its count (the tests' view of the trie)
  std::vector<std::pair<std::vector<int64_t>, int64_t>> paths() const {
    std::vector<std::pair<std::vector<int64_t>, int64_t>> out;
    std::vector<std::pair<std::vector<int64_t>, int32_t>> stack{{{}, 0}};
    while (!stack.empty()) {
      auto [path, node] = stack.back();
      stack.pop_back();
      for (int32_t c = nodes_[node].first; c >= 0; c = nodes_[c].next) {
        auto longer = path;
        longer.push_back(nodes_[c].token);
        out.emplace_back(longer, nodes_[c].count);
        stack.emplace_back(std::move(longer), c);
      }
    }
    return out;
  }

  int64_t live_nodes() const { return static_cast<int64_t>(nodes_.size() - free_.size()); }

 private:
  int32_t child_or_new(int32_t parent, int64_t token) {
    const uint64_t k = EdgeMap::key(parent, token);
    int32_t c = edges_.find(k);
    if (c >= 0) return c;
    if (!free_.empty()) {
      c = free_.back();
      free_.pop_back();
      nodes_[c] = Node();
    } else {
      c = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
    }
    Node& n = nodes_[c];
    n.token = token;
    n.parent = parent;
    n.next = nodes_[parent].first;
    if (n.next >= 0) nodes_[n.next].prev = c;
    nodes_[parent].first = c;
    edges_.insert(k, c);
    return c;
  }

  void unlink(int32_t c) {  // out of its parent's children and the edge map
    Node& n = nodes_[c];
    if (n.prev >= 0) nodes_[n.prev].next = n.next;
    else nodes_[n.parent].first = n.next;
    if (n.next >= 0) nodes_[n.next].prev = n.prev;
    edges_.erase(EdgeMap::key(n.parent, n.token));
  }

  void release(int32_t node) {  // the node and its subtree to the free list (the node already unlinked)
    std::vector<int32_t> stack{node};
    while (!stack.empty()) {
      const int32_t n = stack.back();
      stack.pop_back();
      for (int32_t c = nodes_[n].first; c >= 0; c = nodes_[c].next) {
        edges_.erase(EdgeMap::key(n, nodes_[c].token));
        stack.push_back(c);
      }
      nodes_[n].first = -1;
      nodes_[n].count = 0;
      free_.push_back(n);
    }
  }

  int64_t max_depth_;
  std::vector<Node> nodes_;
  EdgeMap edges_;
  std::vector<int32_t> free_;
  int64_t clock_ = 0;
  std::unordered_map<int64_t, std::vector<int64_t>> tokens_;
  std::unordered_map<int64_t, std::vector<int32_t>> open_;
};

std::string isa() { return "portable"; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Trie>(m, "Trie")
      .def(py::init<int64_t>())
      .def("contains", &Trie::contains)
      .def("extend", &Trie::extend)
      .def("remove", &Trie::remove)
      .def("propose", &Trie::propose)
      .def("paths", &Trie::paths)
      .def("live_nodes", &Trie::live_nodes);
  m.def("isa", &isa);
}
