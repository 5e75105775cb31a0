// strata-decode: a decode node. Reads its settings from the cluster file (its entry by id, and
// what the cluster serves: model, codec, chunk size, store); flags override.
//   strata-decode --cluster cluster.json --node decode-0
#include "decode_node/decode_node_main.h"

int main(int argc, char** argv) { return strata::decode::RunDecodeNode(argc, argv); }
