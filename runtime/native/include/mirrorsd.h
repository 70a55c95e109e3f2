/* libmirrorsd: ar, sd and Mirror-SD decoding of a mirrorsd export folder, with a C ABI.
 *
 *   mirrorsd_model* model = NULL;
 *   mirrorsd_open_options options;
 *   mirrorsd_open_options_init(&options);                 // auto devices, default threads
 *   if (mirrorsd_open("exports/smollm2", &options, &model) != MIRRORSD_OK) puts(mirrorsd_last_error());
 *   mirrorsd_generate_config config;
 *   mirrorsd_generate_config_init(&config);               // runtime/config.py's defaults (mode mirror: no auto)
 *   mirrorsd_stats stats;
 *   stats.struct_size = sizeof stats;
 *   mirrorsd_generate(model, prompt_ids, prompt_length, &config, on_token, user_data, &stats);
 *   mirrorsd_close(model);
 *
 * Token ids in, token ids out: there is no tokenizer here (use the folder's tokenizer/tokenizer.json elsewhere).
 * Greedy decoding only: every mode emits the target's argmax tokens, exactly what `ar` emits.
 * Every tensor name comes from the folder's mirrorsd.json; docs/graphs.md is the contract this library follows.
 *
 * Errors: every function that can fail returns a mirrorsd_status; mirrorsd_last_error() then holds a message that
 * says what went wrong, why, and what to do (per thread, until that thread's next call into this library).
 * Threads: a model runs one generation at a time (concurrent calls on one model wait for each other); separate
 * models are independent. Mirror-SD runs the draft on a thread of its own inside mirrorsd_generate.
 * Handles: a mirrorsd_model* is an opaque handle, never an address. Misuse is an error, never a crash or a hang,
 * wherever the library can see it: a handle that is not open (closed already, never opened) is
 * MIRRORSD_ERROR_INVALID_ARGUMENT; mirrorsd_generate or mirrorsd_close on a model from inside that model's own
 * on_token callback, and mirrorsd_close while another thread generates with the model, are MIRRORSD_ERROR_BUSY.
 */
#ifndef MIRRORSD_H
#define MIRRORSD_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#if defined(MIRRORSD_BUILDING)
#define MIRRORSD_API __declspec(dllexport)
#else
#define MIRRORSD_API __declspec(dllimport)
#endif
#else
#define MIRRORSD_API __attribute__((visibility("default")))
#endif

/* ABI 2 appended kernels_library to mirrorsd_open_options and target_kernels/draft_kernels to mirrorsd_model_info;
 * mirrorsd_open and mirrorsd_model_get_info still accept the older struct sizes. ABI 3: mirrorsd_close returns a
 * status (it was void; callers that ignore it keep working), MIRRORSD_ERROR_BUSY, every numeric option is bounded
 * (see the fields), the settings carry the Python runtime's names (fallback_on_draft_failure became
 * on_draft_failure, the same int32 in the same place), and mirrorsd_model_info ends with the thread counts.
 * Names, defaults and bounds of mirrorsd_generate_config are runtime/config.py's (GenerationConfig). */
#define MIRRORSD_ABI_VERSION 3
#define MIRRORSD_MAX_EOS 8

typedef enum mirrorsd_status {
  MIRRORSD_OK = 0,
  MIRRORSD_ERROR_INVALID_ARGUMENT = 1, /* a null pointer, an option out of range, a prompt id outside the vocab */
  MIRRORSD_ERROR_MANIFEST = 2,         /* no such folder, no/damaged/unsupported mirrorsd.json, unsafe file names */
  MIRRORSD_ERROR_GRAPH_FILE = 3,       /* an ONNX file is missing, damaged, or does not match the manifest */
  MIRRORSD_ERROR_DEVICE = 4,           /* a requested device / execution provider is not available here */
  MIRRORSD_ERROR_RUNTIME = 5,          /* ONNX Runtime failed while running a graph */
  MIRRORSD_ERROR_DRAFT_WORKER = 6,     /* the draft (sd) or the Mirror-SD draft worker failed or timed out */
  MIRRORSD_ERROR_INTERNAL = 7,         /* a bug in libmirrorsd: please report it with the message */
  MIRRORSD_ERROR_BUSY = 8              /* the model is in use: a call from inside its own on_token callback, or
                                          mirrorsd_close while another thread generates with it */
} mirrorsd_status;

typedef enum mirrorsd_mode {
  MIRRORSD_MODE_AR = 0,    /* target only: one token per target step */
  MIRRORSD_MODE_SD = 1,    /* vanilla speculative decoding: draft gamma tokens, then verify them in one step */
  MIRRORSD_MODE_MIRROR = 2 /* Mirror-SD: the draft rolls out next windows while the target verifies */
} mirrorsd_mode;

typedef enum mirrorsd_branch_budget {
  MIRRORSD_BUDGET_TIME = 0, /* roll out branches until the verdict arrives (the paper's overlap budget) */
  MIRRORSD_BUDGET_CAP = 1   /* always roll out `branches` before reading the verdict (deterministic) */
} mirrorsd_branch_budget;

typedef enum mirrorsd_draft_failure {
  MIRRORSD_DRAFT_FAILURE_RAISE = 0,   /* a failing draft fails the generation (MIRRORSD_ERROR_DRAFT_WORKER) */
  MIRRORSD_DRAFT_FAILURE_FALLBACK = 1 /* a failing draft switches to target-only decoding (counted in stats) */
} mirrorsd_draft_failure;

typedef enum mirrorsd_finish_reason {
  MIRRORSD_FINISH_LENGTH = 0,  /* max_new_tokens reached */
  MIRRORSD_FINISH_EOS = 1,     /* an end-of-sequence token was emitted (it is the last token) */
  MIRRORSD_FINISH_CONTEXT = 2, /* the exported graphs' context is full */
  MIRRORSD_FINISH_CALLBACK = 3 /* the token callback asked to stop */
} mirrorsd_finish_reason;

typedef struct mirrorsd_model mirrorsd_model;

/* Where the graphs run. Device strings: NULL or "auto", "cpu", "cuda", "ort-openvino:CPU", "ort-openvino:GPU".
 * auto: the target takes cuda when this ONNX Runtime build has it, else cpu; the draft takes cpu.
 * kernels_library: mirrorsd's MatMulNBits kernels (devices/kernels, libmirrorsd_kern.so; Python:
 * mirrorsd.devices.kernels.usable_library().path). Every CPU session whose graph imports the com.microsoft domain
 * registers it in replace mode, so every int4/int8 MatMulNBits node runs it: a row's bits then do not depend on the
 * rows beside it, which sd and mirror need to emit exactly ar's tokens on a quantized grouped-attention target
 * (ONNX Runtime's own kernel with int8 activations is not row-invariant on every CPU). NULL or "" = ONNX Runtime's
 * own kernel. mirrorsd_open_options_init writes the whole struct: a caller built against ABI 1 that calls it must be
 * rebuilt (one that fills the struct itself, with ABI 1's struct_size, keeps working). */
typedef struct mirrorsd_open_options {
  uint32_t struct_size;            /* sizeof(mirrorsd_open_options): set by mirrorsd_open_options_init */
  const char* target_device;       /* prefix, exit head and suffix graphs */
  const char* draft_device;        /* the draft graph */
  int32_t target_threads;          /* intra-op threads per target session: 0 = every core, else 1..cores */
  int32_t draft_threads;           /* intra-op threads of the draft session: 0 = every core, else 1..cores */
  const char* openvino_ep_library; /* ort-openvino without a built-in OpenVINO EP: path of the OpenVINO plugin EP
                                      library (onnxruntime-ep-openvino); NULL otherwise */
  const char* kernels_library;     /* path of libmirrorsd_kern.so, or NULL / "" for ONNX Runtime's kernel (ABI 2) */
} mirrorsd_open_options;

typedef struct mirrorsd_generate_config {
  uint32_t struct_size;      /* sizeof(mirrorsd_generate_config): set by mirrorsd_generate_config_init */
  int32_t mode;              /* mirrorsd_mode */
  int32_t max_new_tokens;    /* >= 1 */
  int32_t gamma;             /* draft window: tokens proposed per step, >= 1; sd and mirror: below the context */
  int32_t branches;          /* mirror: branches rolled out per step at most, >= 1 */
  int32_t branch_batch;      /* mirror: branches per batched draft call, >= 1 */
  int32_t runner_up_k;       /* mirror: the draft's own candidate tokens kept per window position, 1..vocab_size */
  int32_t branch_budget;     /* mirror: mirrorsd_branch_budget */
  int32_t exit_head;         /* mirror: 1 = send the early exit's top-k to the draft worker; 0 = draft runner-ups */
  int32_t on_draft_failure;  /* mirrorsd_draft_failure */
  double draft_timeout_s;    /* mirror: the longest wait for the draft worker's window, > 0 seconds; from
                                MIRRORSD_DRAFT_TIMEOUT_NEVER_S up (or infinity) = no limit */
} mirrorsd_generate_config;

/* A draft_timeout_s at or above this many seconds (about 31 years) waits without a limit. */
#define MIRRORSD_DRAFT_TIMEOUT_NEVER_S 1e9

/* Called for every emitted token, in order, as soon as it is committed. Return 0 to go on, anything else to stop
 * (the token just passed is kept; finish_reason becomes MIRRORSD_FINISH_CALLBACK). */
typedef int32_t (*mirrorsd_token_callback)(int64_t token, void* user_data);

typedef struct mirrorsd_stats {
  uint32_t struct_size;           /* the caller sets sizeof(mirrorsd_stats) before the call */
  int32_t mode;
  int32_t finish_reason;          /* mirrorsd_finish_reason */
  int32_t reserved;
  int64_t prompt_tokens;
  int64_t new_tokens;
  int64_t steps;                  /* target verification passes after the prefill */
  int64_t drafted;                /* draft tokens verified */
  int64_t accepted;               /* of those, accepted */
  int64_t windows;                /* steps that verified a draft window */
  int64_t reused;                 /* windows taken from a branch rolled out before the verdict (Mirror-SD) */
  int64_t fallbacks;              /* windows drafted after the verdict */
  int64_t draft_forwards;         /* draft graph calls */
  int64_t branches_rolled_out;
  int64_t draft_failures;         /* draft failures survived by falling back to target-only decoding */
  double seconds;                 /* wall time of the whole generation */
  double time_to_first_token_s;
  double tokens_per_second;
  double decode_tokens_per_second; /* after the first token */
  double mean_accepted_tokens;    /* (accepted + steps) / steps; 1.00 for ar */
  double acceptance_rate;         /* accepted / drafted */
  double reuse_rate;              /* reused / windows */
  double target_busy_s;           /* time inside target graph calls */
  double draft_busy_s;            /* time inside draft graph calls */
  double draft_hidden_s;          /* draft time that overlapped target time */
  double overlap_ratio;           /* draft_hidden_s / draft_busy_s */
} mirrorsd_stats;

typedef struct mirrorsd_model_info {
  uint32_t struct_size;           /* the caller sets sizeof(mirrorsd_model_info) before the call */
  int32_t eos_count;              /* how many of eos_token_ids are used */
  int64_t vocab_size;
  int64_t context_limit;          /* prompt + new tokens never exceed this */
  int64_t target_layers;
  int64_t exit_layer;
  int64_t draft_layers;
  int64_t top_k;                  /* width of the exit head's top-k */
  int64_t eos_token_ids[MIRRORSD_MAX_EOS];
  char target_provider[64];       /* the execution provider the target's sessions run on */
  char draft_provider[64];
  char target_kernels[16];        /* MatMulNBits kernel of the target's sessions: "mirrorsd" (kernels_library) when
                                     any of them registered it, else "ort" (ABI 2) */
  char draft_kernels[16];         /* the same for the draft's session (ABI 2) */
  int32_t target_threads;         /* intra-op threads of each target session (ABI 3) */
  int32_t draft_threads;          /* intra-op threads of the draft session (ABI 3) */
} mirrorsd_model_info;

MIRRORSD_API const char* mirrorsd_version(void);
MIRRORSD_API const char* mirrorsd_last_error(void);

MIRRORSD_API void mirrorsd_open_options_init(mirrorsd_open_options* options);
MIRRORSD_API void mirrorsd_generate_config_init(mirrorsd_generate_config* config);

/* Open an export folder (reads mirrorsd.json, checks every graph file, opens one session per graph). */
MIRRORSD_API mirrorsd_status mirrorsd_open(const char* folder, const mirrorsd_open_options* options,
                                           mirrorsd_model** model);
MIRRORSD_API mirrorsd_status mirrorsd_model_get_info(const mirrorsd_model* model, mirrorsd_model_info* info);

/* Greedy generation after `prompt` (ids in 0..vocab_size-1). on_token is required; stats may be NULL. on_token may
 * call into this library, except mirrorsd_generate and mirrorsd_close on the same model (MIRRORSD_ERROR_BUSY). */
MIRRORSD_API mirrorsd_status mirrorsd_generate(mirrorsd_model* model, const int64_t* prompt, int32_t prompt_length,
                                               const mirrorsd_generate_config* config, mirrorsd_token_callback on_token,
                                               void* user_data, mirrorsd_stats* stats);

/* Free a model (NULL is allowed: MIRRORSD_OK). A handle that is not open is MIRRORSD_ERROR_INVALID_ARGUMENT; a model
 * that is generating (another thread's mirrorsd_generate, or a call from its own on_token) is MIRRORSD_ERROR_BUSY and
 * stays open: close it once mirrorsd_generate has returned. */
MIRRORSD_API mirrorsd_status mirrorsd_close(mirrorsd_model* model);

#ifdef __cplusplus
}
#endif

#endif /* MIRRORSD_H */
