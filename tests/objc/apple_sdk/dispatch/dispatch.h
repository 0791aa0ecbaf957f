// Minimal libdispatch declarations for the Objective-C++ syntax check (see ../README.md).
// Under Objective-C (OS_OBJECT_USE_OBJC) dispatch objects are Objective-C objects
// managed by ARC, as on macOS.
#pragma once

#ifdef __OBJC__
#include <objc/objc.h>

@protocol OS_dispatch_object <NSObject>
@end
@protocol OS_dispatch_queue <OS_dispatch_object>
@end
typedef NSObject<OS_dispatch_queue>* dispatch_queue_t;
#else
typedef struct dispatch_queue_s* dispatch_queue_t;
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef void (^dispatch_block_t)(void);

// Submits `block` to `queue` and waits for it to finish; the block never outlives the call.
void dispatch_sync(dispatch_queue_t queue, __attribute__((__noescape__)) dispatch_block_t block);

#ifdef __cplusplus
}
#endif
