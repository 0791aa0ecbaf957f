// Minimal MPSGraph declarations for the syntax check (see ../README.md): only the classes
// ATen/mps/MPSStream.h names.
#pragma once

#include <MetalPerformanceShaders/MetalPerformanceShaders.h>

#ifdef __OBJC__

// MPSGraphCore.h / MPSGraph.h
@interface MPSGraphObject : NSObject
@end

@interface MPSGraphCompilationDescriptor : MPSGraphObject <NSCopying>
@end

@interface MPSGraphExecutionDescriptor : MPSGraphObject
@end

@interface MPSGraph : MPSGraphObject
@end

#endif  // __OBJC__
