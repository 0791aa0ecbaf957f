// Minimal Foundation declarations for the Objective-C++ syntax check (see ../README.md).
#pragma once

#include <stdint.h>

#include <dispatch/dispatch.h>
#include <objc/objc.h>

#ifdef __OBJC__

NS_ASSUME_NONNULL_BEGIN

@protocol NSCopying
@end

@interface NSString : NSObject <NSCopying>
+ (nullable instancetype)stringWithUTF8String:(const char*)nullTerminatedCString;
@property(nullable, readonly) const char* UTF8String NS_RETURNS_INNER_POINTER;
@property(readonly) NSUInteger length;
@end

typedef NSString* NSErrorDomain;

@interface NSDictionary<__covariant KeyType, __covariant ObjectType> : NSObject <NSCopying>
@property(readonly) NSUInteger count;
- (nullable ObjectType)objectForKey:(KeyType)aKey;
@end

@interface NSArray<__covariant ObjectType> : NSObject <NSCopying>
@property(readonly) NSUInteger count;
@end

@interface NSError : NSObject <NSCopying>
@property(readonly, copy) NSErrorDomain domain;
@property(readonly) NSInteger code;
@property(readonly, copy) NSString* localizedDescription;
@end

NS_ASSUME_NONNULL_END

#endif  // __OBJC__
