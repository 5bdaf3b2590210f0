/* The cb_eval callback of a non-final stage, in C.
 *
 * llama.cpp asks the callback about every graph node up to the one it wants; in Python
 * that costs ~1.2 us per node (~0.4 ms per token for a 10-layer stage). This does the
 * same work as meshnode/engine/ggml.py:LayerTap for the one case on the hot path: copy
 * the tensor named `target` (l_out-{n-1}) into `buf`, then stop the graph.
 * Built on first use with the system C compiler (see native.py); no Python API used.
 */
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

typedef const char *(*get_name_fn)(const void *tensor);
typedef size_t (*nbytes_fn)(const void *tensor);
typedef void (*tensor_get_fn)(const void *tensor, void *data, size_t offset, size_t size);

struct meshnode_tap {
    char target[64];
    get_name_fn get_name;
    nbytes_fn nbytes;
    tensor_get_fn tensor_get;
    char *buf;
    size_t cap;
    size_t written;
};

bool meshnode_tap_cb(void *tensor, bool ask, void *user_data) {
    struct meshnode_tap *s = (struct meshnode_tap *)user_data;
    if (strncmp(s->get_name(tensor), s->target, sizeof s->target) != 0) {
        return !ask; /* not ours: don't want its data; (never called with ask=false) */
    }
    if (ask) {
        return true;
    }
    size_t n = s->nbytes(tensor);
    if (s->written + n > s->cap) {
        return false; /* never write past the buffer; the owner sees a short capture */
    }
    s->tensor_get(tensor, s->buf + s->written, 0, n);
    s->written += n;
    return false; /* stop: the output norm and lm_head never run */
}
