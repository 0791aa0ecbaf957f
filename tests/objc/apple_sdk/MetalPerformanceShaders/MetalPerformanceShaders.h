// Minimal Metal Performance Shaders declarations for the syntax check (see ../README.md):
// only the class ATen/mps/MPSStream.h names.
#pragma once

#include <Metal/Metal.h>

#ifdef __OBJC__

NS_ASSUME_NONNULL_BEGIN

// MPSCore/MPSCommandBuffer.h
@interface MPSCommandBuffer : NSObject <MTLCommandBuffer>
@property(readonly, retain, nonatomic) id<MTLCommandBuffer> commandBuffer;
@end

NS_ASSUME_NONNULL_END

#endif  // __OBJC__
