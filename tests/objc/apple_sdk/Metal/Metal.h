// Minimal Metal declarations for the Objective-C++ syntax check (see ../README.md).
// Signatures as in Apple's Metal framework reference. Deliberately absent:
// -[MTLCommandEncoder endEncoding] and -[MTLCommandBuffer computeCommandEncoder]
// (PyTorch owns the encoder; the op must neither end it nor open another one).
#pragma once

#include <Foundation/Foundation.h>

#ifdef __OBJC__

NS_ASSUME_NONNULL_BEGIN

// ---- MTLTypes.h
typedef struct {
  NSUInteger width, height, depth;
} MTLSize;

static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize size = {width, height, depth};
  return size;
}

// ---- MTLLibrary.h
typedef NS_ENUM(NSUInteger, MTLLanguageVersion){
    MTLLanguageVersion3_0 = (3 << 16) + 0,
    MTLLanguageVersion3_1 = (3 << 16) + 1,
    MTLLanguageVersion3_2 = (3 << 16) + 2,
};

@protocol MTLDevice;

@interface MTLCompileOptions : NSObject <NSCopying>
@property(nullable, readwrite, copy, nonatomic) NSDictionary<NSString*, NSObject*>* preprocessorMacros;
// Deprecated from macOS 15 in favour of mathMode, which macOS 14 lacks.
@property(readwrite, nonatomic) BOOL fastMathEnabled;
@property(readwrite, nonatomic) MTLLanguageVersion languageVersion;
@end

// ---- MTLArgument.h (the scalar data types function constants use here)
typedef NS_ENUM(NSUInteger, MTLDataType){
    MTLDataTypeFloat = 3,
    MTLDataTypeHalf = 16,
    MTLDataTypeInt = 29,
    MTLDataTypeUInt = 33,
    MTLDataTypeShort = 37,
    MTLDataTypeUShort = 41,
    MTLDataTypeChar = 45,
    MTLDataTypeUChar = 49,
    MTLDataTypeBool = 53,
};

// ---- MTLFunctionConstantValues.h
@interface MTLFunctionConstantValues : NSObject <NSCopying>
- (void)setConstantValue:(const void*)value type:(MTLDataType)type atIndex:(NSUInteger)index;
@end

@protocol MTLFunction <NSObject>
@property(readonly) id<MTLDevice> device;
@property(readonly) NSString* name;
@end

@protocol MTLLibrary <NSObject>
@property(readonly) id<MTLDevice> device;
@property(readonly) NSArray<NSString*>* functionNames;
- (nullable id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
- (nullable id<MTLFunction>)newFunctionWithName:(NSString*)name
                                 constantValues:(MTLFunctionConstantValues*)constantValues
                                          error:(__autoreleasing NSError* _Nullable* _Nullable)error;
@end

// ---- MTLComputePipeline.h
@protocol MTLComputePipelineState <NSObject>
@property(readonly) id<MTLDevice> device;
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property(readonly) NSUInteger threadExecutionWidth;
@property(readonly) NSUInteger staticThreadgroupMemoryLength;
@end

// ---- MTLResource.h / MTLBuffer.h
@protocol MTLResource <NSObject>
@property(readonly) id<MTLDevice> device;
@end

@protocol MTLBuffer <MTLResource>
@property(readonly) NSUInteger length;
@end

// ---- MTLCommandEncoder.h / MTLComputeCommandEncoder.h
@protocol MTLCommandEncoder <NSObject>
@property(readonly) id<MTLDevice> device;
@property(nullable, copy, atomic) NSString* label;
- (void)pushDebugGroup:(NSString*)string;
- (void)popDebugGroup;
@end

@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(nullable id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@end

// ---- MTLCommandBuffer.h / MTLCommandQueue.h / MTLEvent.h (named by ATen/mps/MPSStream.h)
@protocol MTLCommandBuffer <NSObject>
@property(readonly) id<MTLDevice> device;
@end

typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);

@protocol MTLCommandQueue <NSObject>
@property(readonly) id<MTLDevice> device;
@end

@protocol MTLEvent <NSObject>
@property(nullable, readonly) id<MTLDevice> device;
@end

@protocol MTLSharedEvent <MTLEvent>
@property(readwrite) uint64_t signaledValue;
@end

// ---- MTLDevice.h
@protocol MTLDevice <NSObject>
@property(readonly) NSString* name;
@property(readonly) NSUInteger maxThreadgroupMemoryLength;
@property(readonly) MTLSize maxThreadsPerThreadgroup;
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                                        options:(nullable MTLCompileOptions*)options
                                          error:(__autoreleasing NSError* _Nullable* _Nullable)error;
- (nullable id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                                      error:(__autoreleasing NSError* _Nullable* _Nullable)error;
@end

NS_ASSUME_NONNULL_END

#endif  // __OBJC__
